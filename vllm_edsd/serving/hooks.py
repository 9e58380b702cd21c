"""The replacements that put the features beyond the paper (``features/``) into vLLM's engine.

The features themselves know nothing of vLLM's classes; these wrappers hand them what they
need where vLLM builds its engine config, accepts a request, loads the proposer and drafts:

* ``create_engine_config``: the verifier of a drafter directory served alone is looked for
  before vLLM loads it (``preflight``); the adaptive draft length and the prompt lookup are
  refused on a runner that cannot hand on drafts of different lengths;
* ``_validate_params``, ``preprocess_add_request``: a request's draft-length cap is checked
  (a bad one fails that request alone), and a request capped at 0 gets its own prefix-cache
  salt;
* ``load_model``, ``propose_draft_token_ids``: the loaded proposer is hooked with the
  draft-length limiter (``attach``), which the runner hands each step's caps and, with the
  prompt lookup, the rows the lookup drafts.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

from vllm_edsd.errors import EDSDError
from vllm_edsd.launch.engine import NATIVE_CPU_FLAGS, cpu_computes_natively, cpu_dtype, on_cpu
from vllm_edsd.methods import EDSD_METHOD
from vllm_edsd.serving import draft_vocab, preflight
from vllm_edsd.serving.features import draft_length, lookup
from vllm_edsd.serving.user_errors import errors_for_the_user

logger = logging.getLogger("vllm.edsd")  # a child of vLLM's logger: its handlers and level

_ARCHITECTURES = set(EDSD_METHOD.served_layout.architectures)


def checked_engine_config(original: Callable) -> Callable:
    """``EngineArgs.create_engine_config`` that looks for the verifier of a drafter directory
    served alone before vLLM loads it, and refuses the adaptive draft length and the prompt
    lookup where the engine cannot hand on drafts of different lengths, once vLLM has chosen
    the model runner and the scheduling."""

    def create_engine_config(self, *args: Any, **kwargs: Any) -> Any:
        with errors_for_the_user():
            preflight.check_verifier(self.model)
        config = original(self, *args, **kwargs)
        spec = config.speculative_config
        draft = None if spec is None else spec.draft_model_config
        if draft is not None and draft_length.AdaptiveDraftLength.of(draft.hf_config) is not None:
            with errors_for_the_user():
                draft_length.check_runner(repr(draft_length.ENABLE), config)
        if spec is not None and spec.method == EDSD_METHOD.vllm_method and lookup.PromptLookup.of(spec) is not None:
            with errors_for_the_user():
                draft_length.check_runner(lookup.FEATURE, config)
        if draft is not None and _ARCHITECTURES & set(draft.architectures or []):
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
    lookup where the speculative config asks for it), and its drafts with sampling in the draft
    vocabulary (``draft_vocab``)."""
    from vllm_edsd.methods.edsd.vllm_model import EDSDLlamaForCausalLM  # imports vLLM: only once an engine loads

    if draft_length.limiter_of(proposer) is not None:
        return  # hooked already (load_model called again): a second hook would wrap the first
    model = proposer.model
    model = model.unwrap() if hasattr(model, "unwrap") else model
    settings = draft_length.AdaptiveDraftLength.of(model.config) if isinstance(model, EDSDLlamaForCausalLM) else None
    if settings is not None and getattr(proposer, "use_local_argmax_reduction", False):
        raise EDSDError(f"{draft_length.ENABLE!r} needs the drafter's full logits: remove use_local_argmax_reduction")
    data_parallel = proposer.vllm_config.parallel_config.data_parallel_size > 1
    draft_vocab.hook(proposer, model)  # first: the limiter wraps the draft-vocabulary sampling
    limiter = draft_length.DraftLengthLimiter(proposer, model, settings, data_parallel)
    prompt_lookup = lookup.PromptLookup.of(proposer.vllm_config.speculative_config)
    if prompt_lookup is not None:
        limiter.lookup = lookup.LookupDrafting(prompt_lookup)


def hooked_proposer_loading(original: Callable) -> Callable:
    """``load_model`` of vLLM's V1 EAGLE proposer that then hooks it (``attach``)."""

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        attach(self)

    return load_model


def capped_drafting(original: Callable) -> Callable:
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


def salted_opt_outs(original: Callable) -> Callable:
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


def checked_request_params(original: Callable) -> Callable:
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
