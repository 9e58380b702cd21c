"""The speculative config of a request for an EDSD drafter, checked and handed to vLLM.

``"method": "edsd"`` is a front-end alias: ``SpeculativeConfig.__init__`` is wrapped to check the
drafter and translate the method to vLLM's EAGLE-3 before pydantic validates it. Everything
downstream (aux hidden states, the EAGLE proposer, KV lookahead, the rejection sampler,
metrics, compilation) is vLLM's own EAGLE-3 path. The keys of the features beyond the paper
(``features/draft_length.py``, ``features/lookup.py``) are taken out before vLLM sees them and
carried to the workers once vLLM has built the config.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from vllm_edsd.checkpoint.files import tensor_shapes
from vllm_edsd.checkpoint.target import TargetFingerprint, read_config_json
from vllm_edsd.checkpoint.vocab_map import check_checkpoint_vocab_mapping
from vllm_edsd.errors import EDSDError, positive_int
from vllm_edsd.methods import EAGLE3_METHOD, EDSD_METHOD, detect_layout
from vllm_edsd.methods.edsd.config import EDSDConfig
from vllm_edsd.methods.edsd.model import check_tensors
from vllm_edsd.serving import preflight
from vllm_edsd.serving.features import draft_length, lookup
from vllm_edsd.serving.user_errors import errors_for_the_user
from vllm_edsd.serving.versions import range_message, vllm_version

logger = logging.getLogger("vllm.edsd")  # a child of vLLM's logger: its handlers and level

METHOD = EDSD_METHOD.name  # the speculative config's "method" (and a speculators config's model type)
VLLM_METHOD = EDSD_METHOD.vllm_method  # vLLM's method that serves "edsd"
VLLM_EAGLE3 = EAGLE3_METHOD.vllm_method  # vLLM's own EAGLE-3, which takes the prompt lookup too
SERVED_LAYOUT = EDSD_METHOD.served_layout
DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")
DEFAULT_DRAFT_SAMPLE_METHOD = "probabilistic"  # vLLM's default is "greedy" (docs/serving.md, "Sampling")


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


def _check_fields(kwargs: dict[str, Any], known_fields: set[str]) -> str:
    """The fields every ``"edsd"`` config needs right, whatever its drafter; its ``model``."""
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
            f"speculative config: method {METHOD!r} needs 'model': the directory of a converted EDSD drafter"
        )
    return model


def check_speculative_request(kwargs: dict[str, Any], known_fields: set[str]) -> EDSDConfig | None:
    """Checks on an ``"edsd"`` speculative config before vLLM sees it.

    Returns the drafter's config when the drafter is a local directory (a hub id is left
    to vLLM to resolve and is checked against the target afterwards).
    """
    model = _check_fields(kwargs, known_fields)
    if not preflight.locate(model):
        return None
    raw = read_config_json(model)
    draft_length.refuse_checkpoint_settings(raw, f"{model}/config.json")
    # Header-only reads: a broken checkpoint fails here, naming the tensor, rather than
    # deep inside an engine worker.
    shapes = tensor_shapes(model)
    layout = detect_layout(raw, shapes, source=f"{model}/config.json")
    if layout is EAGLE3_METHOD.served_layout:
        raise EDSDError(f"{model}: an EAGLE-3 drafter, not EDSD: use \"method\": \"{VLLM_EAGLE3}\"")
    if layout is not SERVED_LAYOUT:
        raise EDSDError(
            f"{model}: {layout.describe}, not the vLLM layout; convert it first: edsd convert {model} OUTPUT_DIR"
        )
    drafter = SERVED_LAYOUT.read_config(raw, source=f"{model}/config.json")
    check_tensors(drafter, shapes, SERVED_LAYOUT, source=model)
    check_checkpoint_vocab_mapping(model, drafter.vocab_size, drafter.draft_vocab_size)
    return drafter


def _other_method(original: Callable, config: Any, args: tuple, kwargs: dict[str, Any]) -> None:
    """A request for any method but ``"edsd"``: the plugin's draft-length keys are refused there,
    and vLLM's own EAGLE-3 keeps the prompt lookup keys, which vLLM would zero; every other
    method keeps vLLM's meaning of them."""
    method = kwargs.get("method")
    owners = {**dict.fromkeys(draft_length.FIELDS, f'"{METHOD}"'),
              lookup.DRAFTER_KEY: f'"{METHOD}" and "{VLLM_EAGLE3}"'}
    stray = sorted(key for key in set(kwargs) & set(owners)
                   if not (key == lookup.DRAFTER_KEY and method == VLLM_EAGLE3))
    if stray:
        raise EDSDError(f"speculative config: {', '.join(map(repr, stray))} is an option of "
                        f"\"method\": {owners[stray[0]]}, not of {method!r}")
    prompt_lookup = lookup.PromptLookup.pop_from(kwargs) if method == VLLM_EAGLE3 else None
    original(config, *args, **kwargs)
    if prompt_lookup is not None:
        prompt_lookup.put_on(config)


def _loaded_drafter(config: Any, model: str) -> EDSDConfig:
    """The drafter vLLM resolved itself (e.g. a hub id), checked once it is loaded."""
    raw = config.draft_model_config.hf_config.to_dict()
    if not set(SERVED_LAYOUT.architectures) & set(config.draft_model_config.architectures or []):
        raise EDSDError(f"{model}: not an EDSD drafter (architectures={raw.get('architectures')})")
    return SERVED_LAYOUT.read_config(raw, source=f"{model}/config.json")


def checked_speculative_init(original: Callable) -> Callable:
    """``SpeculativeConfig.__init__`` that checks an ``"edsd"`` request and hands vLLM ``"eagle3"``."""
    from vllm.config import SpeculativeConfig

    known_fields = set(SpeculativeConfig.__dataclass_fields__)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        with errors_for_the_user():
            kwargs = dict(kwargs)
            if kwargs.get("method") != METHOD:
                _other_method(original, self, args, kwargs)
                return
            adaptive_length = draft_length.AdaptiveDraftLength.pop_from(kwargs)
            prompt_lookup = lookup.PromptLookup.pop_from(kwargs)
            drafter = check_speculative_request(kwargs, known_fields)
            kwargs = with_default_draft_sampling(kwargs, known_fields)
            original(self, *args, **{**kwargs, "method": VLLM_METHOD})
            if drafter is None:  # resolved by vLLM (e.g. a hub id): check what it loaded
                drafter = _loaded_drafter(self, kwargs["model"])
            target = TargetFingerprint.from_hf_config(self.target_model_config.hf_text_config)
            drafter.check_target(target, drafter=f"EDSD drafter {kwargs['model']}")
            if adaptive_length is not None:
                setattr(self.draft_model_config.hf_config, draft_length.CONFIG_ATTRIBUTE, adaptive_length.as_dict())
            if prompt_lookup is not None:
                prompt_lookup.put_on(self)

    return __init__


def refusing_speculative_init(original: Callable) -> Callable:
    """``SpeculativeConfig.__init__`` on a vLLM outside the supported range: an ``"edsd"``
    request is refused in one line naming the supported range and the installed vLLM (rather
    than vLLM's list of the methods it knows); every other request goes to vLLM as it came."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("method") == METHOD:
            with errors_for_the_user():
                raise EDSDError(range_message(vllm_version()))
        original(self, *args, **kwargs)

    return __init__
