"""A request's draft length: capped by the request, cut where the drafter is unsure.

Both are limits on how many draft tokens one request gets in one step, so they are one
mechanism (docs/architecture.md, "Patches"):

* **Per request.** ``SamplingParams(extra_args={"num_speculative_tokens": n})`` (the server's
  ``vllm_xargs``) caps that request's drafts at n, 0 ≤ n ≤ K; 0 means no drafts for it. Other
  requests in the batch keep K. The front end refuses a bad n for its request only.
* **Entropy-adaptive** (``"adaptive_draft_length": true``, EDSD drafters). EDSD's premise is
  that tokens are rejected where entropy is high: every draft step predicts the acceptance of
  the token just drafted as ``exp(-H)`` (H: the entropy, in nats, of the drafter's
  distribution over its vocabulary at temperature 1). A request whose prediction falls below
  ``adaptive_draft_threshold`` stops drafting: its draft is cut before that token.

Verification is vLLM's own, so the output is unchanged (greedy: identical; sampled: the
target's distribution). Both run on vLLM's V1 model runner with synchronous scheduling, where
drafts reach the scheduler as one list per request (as the n-gram proposer's do), so vLLM
schedules, verifies and counts (``vllm:spec_decode_*``) exactly the tokens kept. The runner
reads each request's cap before it drafts; an EAGLE-family proposer is hooked so that its
draft loop ends once no request of the batch can draft further, and any other proposer's
drafts are cut afterwards.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch

from vllm_edsd.errors import EDSDError

logger = logging.getLogger("vllm.edsd")  # a child of vLLM's logger: its handlers and level

ENABLE = "adaptive_draft_length"
THRESHOLD = "adaptive_draft_threshold"
FIELDS = (ENABLE, THRESHOLD)
DEFAULT_THRESHOLD = 0.1
# Where the settings travel from the front end to the workers: an attribute of the drafter's
# hf_config, which vLLM pickles to every worker with the rest of the config.
CONFIG_ATTRIBUTE = "edsd_adaptive_draft"


class Carried(dict):
    """The settings as the plugin puts them on the drafter's hf_config. JSON writes a dict
    subclass as a dict but never reads one back as this class, so a checkpoint's config.json
    cannot forge it; pickling (to the workers) keeps it."""


@dataclass(frozen=True)
class AdaptiveDraftLength:
    """The validated ``adaptive_draft_*`` fields of an ``"edsd"`` speculative config."""

    threshold: float = DEFAULT_THRESHOLD

    def __post_init__(self) -> None:
        t = self.threshold
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < 1:  # NaN fails too
            raise EDSDError(
                f"speculative config: {THRESHOLD!r} is the predicted acceptance probability below which "
                f"a request stops drafting: a number between 0 and 1 (exclusive), got {t!r}"
            )
        object.__setattr__(self, "threshold", float(t))

    @property
    def max_entropy(self) -> float:
        """The entropy (nats) above which a drafted token is predicted to be rejected."""
        return -math.log(self.threshold)

    @classmethod
    def pop_from(cls, fields: dict[str, Any]) -> AdaptiveDraftLength | None:
        """Remove the adaptive fields from a speculative config dict (vLLM does not know them)
        and validate them; None when the feature is off."""
        enabled = fields.pop(ENABLE, False)
        threshold = fields.pop(THRESHOLD, None)
        if not isinstance(enabled, bool):
            raise EDSDError(f"speculative config: {ENABLE!r} must be true or false, got {enabled!r}")
        if threshold is not None and not enabled:
            raise EDSDError(f"speculative config: {THRESHOLD!r} needs \"{ENABLE}\": true")
        if not enabled:
            return None
        return cls() if threshold is None else cls(threshold)

    def as_dict(self) -> dict[str, float]:
        """What ``CONFIG_ATTRIBUTE`` carries to the workers (see ``of``)."""
        return Carried(threshold=self.threshold)

    @classmethod
    def of(cls, hf_config: Any) -> AdaptiveDraftLength | None:
        """The settings the plugin put on a drafter's hf_config, if any, validated again. A value
        of the same name read from the checkpoint's config.json is ignored with a warning:
        serving options come from the speculative config only."""
        raw = getattr(hf_config, CONFIG_ATTRIBUTE, None)
        if raw is None:
            return None
        if not isinstance(raw, Carried):
            logger.warning("vllm-edsd: ignoring %r in the drafter's config.json: serving options come from the "
                           "speculative config only", CONFIG_ATTRIBUTE)
            return None
        return cls(**raw)


CHECKPOINT_KEYS = (CONFIG_ATTRIBUTE, *FIELDS)


def refuse_checkpoint_settings(raw: dict, source: str) -> None:
    """A drafter's config.json may not switch serving behaviour on: refuse it naming the key."""
    found = [key for key in raw if key in CHECKPOINT_KEYS]
    if found:
        raise EDSDError(f"{source}: key {found[0]!r} is a serving option; it belongs in the speculative config "
                        f"(\"{ENABLE}\", \"{THRESHOLD}\"), not in the drafter's config.json: remove it")


def check_runner(feature: str, vllm_config: Any) -> None:
    """Drafts of different lengths per request need vLLM's V1 runner and synchronous scheduling."""
    if getattr(vllm_config, "use_v2_model_runner", False):
        raise EDSDError(
            f"{feature} runs on vLLM's V1 model runner; this engine uses Model Runner V2: "
            "set VLLM_USE_V2_MODEL_RUNNER=0"
        )
    if vllm_config.scheduler_config.async_scheduling:
        raise EDSDError(
            f"{feature} needs synchronous scheduling (drafts of different lengths per request): "
            "pass --no-async-scheduling (async_scheduling=False)"
        )


REQUEST_KEY = "num_speculative_tokens"
REQUEST_FEATURE = f"a per-request {REQUEST_KEY!r} (SamplingParams.extra_args, the server's vllm_xargs)"


def check_request_cap(extra_args: dict | None, vllm_config: Any) -> None:
    """Refuse a request's draft-length cap that this engine cannot honour, naming why (the
    front end turns this into an error for that request only)."""
    if not extra_args or REQUEST_KEY not in extra_args:
        return
    n = extra_args[REQUEST_KEY]
    spec = vllm_config.speculative_config
    if spec is None:
        raise EDSDError(f"{REQUEST_FEATURE}: this engine does not speculate (it has no speculative config)")
    k = spec.num_speculative_tokens
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= k:
        raise EDSDError(f"{REQUEST_FEATURE} is the most draft tokens this request gets per step: an integer "
                        f"from 0 (no drafts) to {k} (this engine's num_speculative_tokens), got {n!r}")
    if n < k:
        check_runner(REQUEST_FEATURE, vllm_config)


def request_caps(req_ids: list[str], requests: dict[str, Any], k: int) -> list[int] | None:
    """Each batch row's draft-length cap (K where its request sets none), or None when no
    request of the batch asks for fewer than K (then vLLM's drafts pass untouched). The front
    end checked the values (``check_request_cap``)."""
    caps = []
    for req_id in req_ids:
        state = requests.get(req_id)
        extra = getattr(getattr(state, "sampling_params", None), "extra_args", None) or {}
        cap = extra.get(REQUEST_KEY)
        caps.append(k if cap is None else min(int(cap), k))
    return caps if any(cap < k for cap in caps) else None


# The prefix-cache salt of a request capped at 0: its steps may skip the drafter's forward, so
# its blocks can lack the drafter's KV, and no request that drafts may reuse them.
OPTED_OUT_SALT = "vllm-edsd: no drafter KV"


def opted_out(extra_args: dict | None) -> bool:
    """Whether a request's cap is 0: it never drafts, so the drafter need never see it."""
    return bool(extra_args) and extra_args.get(REQUEST_KEY) == 0


def salted_for_opt_out(cache_salt: str | None) -> str:
    """The prefix-cache salt of an opted-out request: its own salt (if any), marked, so that it
    shares cached blocks only with other opted-out requests of the same salt."""
    return OPTED_OUT_SALT if not cache_salt else f"{cache_salt}|{OPTED_OUT_SALT}"


def cut(drafts: torch.Tensor | list[list[int]], caps: list[int]) -> list[list[int]]:
    """One draft list per batch row, at most its cap long."""
    rows = drafts.tolist() if isinstance(drafts, torch.Tensor) else drafts
    return [list(row[:cap]) for row, cap in zip(rows, caps)]


UNCAPPED = torch.iinfo(torch.long).max
LIMITER_ATTRIBUTE = "_edsd_draft_length_limiter"


class StopDrafting(Exception):
    """Raised by the sampling hook when no request can draft further: ends ``propose`` early."""


class DraftLengthLimiter:
    """Hooks one of vLLM's V1 EAGLE-family proposers so that each request drafts only up to
    its cap and, with the adaptive rule, only while its drafter is confident enough.

    vLLM's ``propose`` runs K draft steps and samples each through ``_sample_draft_tokens``;
    the hook there records the chain, updates each request's length and raises
    ``StopDrafting`` once no request can draft further. ``propose`` then returns one list
    per request, cut to its length. The drafter's first forward (which writes its KV cache)
    runs unless every request of the batch is capped at 0 (``every_row_opted_out``): such a
    step proposes nothing and skips the drafter entirely, since those requests never draft
    and their blocks are kept apart in the prefix cache (``salted_for_opt_out``). Under data
    parallelism the ranks agree on batch padding once before the draft loop, so the loop is
    only left from its second step on and the forward is never skipped. The runner sets
    ``caps`` for one ``propose`` call; with neither caps nor the adaptive rule, ``propose`` is
    vLLM's own."""

    def __init__(self, proposer: Any, model: Any, settings: AdaptiveDraftLength | None, data_parallel: bool) -> None:
        self.proposer, self.model, self.settings = proposer, model, settings
        if settings is not None:
            model.record_draft_entropy = True  # the drafter's own switch (EDSDLlamaForCausalLM)
        self.data_parallel = data_parallel
        self._propose, self._sample = proposer.propose, proposer._sample_draft_tokens
        self.caps: list[int] | None = None
        self.every_row_opted_out = False  # set by the runner with caps: every request's own cap is 0
        self.lookup: Any = None  # this worker's prompt lookup (lookup.LookupDrafting), where the config asks for one
        self.tokens: list[torch.Tensor] = []
        self.probs: list[torch.Tensor] = []
        self.lengths: torch.Tensor | None = None
        self._caps: torch.Tensor | None = None
        proposer.propose = self.propose
        proposer._sample_draft_tokens = self.sample_draft_tokens
        setattr(proposer, LIMITER_ATTRIBUTE, self)

    @property
    def first_stop_step(self) -> int:
        """The first draft step after which the loop may end: the second under data parallelism,
        whose ranks pad the drafter's batch together before the loop."""
        return 2 if self.data_parallel else 1

    @property
    def limiting(self) -> bool:
        return self.caps is not None or self.settings is not None

    def sample_draft_tokens(self, hidden_states: torch.Tensor, sampling_metadata: Any) -> tuple[torch.Tensor, Any]:
        tokens, probs = self._sample(hidden_states, sampling_metadata)
        if not self.limiting:
            return tokens, probs
        step = len(self.tokens) + 1
        caps = self._row_caps(tokens.shape[0], tokens.device)
        keep = caps >= step
        if self.settings is not None:
            keep &= self._step_entropy(tokens.shape[0]) <= self.settings.max_entropy
        if self.lengths is None:
            self.lengths = keep.long()
        else:  # a request that stopped stays stopped
            self.lengths += keep & (self.lengths == step - 1)
        self.tokens.append(tokens)
        if probs is not None:
            self.probs.append(probs)
        if step >= self.first_stop_step and bool(((self.lengths < step) | (caps <= step)).all()):
            raise StopDrafting
        return tokens, probs

    def _step_entropy(self, rows: int) -> torch.Tensor:
        """The entropy of each row's draft distribution in this step, which the drafter's
        ``compute_logits`` records; checked explicitly (not by ``assert``, which ``python -O``
        drops), since a missing or stale record would cut drafts by the wrong rows."""
        entropy = self.model.last_draft_entropy
        if entropy is None or entropy.shape[0] != rows:
            recorded = "none" if entropy is None else f"{entropy.shape[0]} rows"
            raise RuntimeError(f"vllm-edsd: the adaptive draft length needs the drafter's entropy for the {rows} "
                               f"rows of this draft step, but the drafter recorded {recorded} (its compute_logits "
                               "did not run on this step's hidden states)")
        return entropy

    def _row_caps(self, rows: int, device: torch.device) -> torch.Tensor:
        """The caps as a tensor over the proposer's rows: unbounded without caps; rows past
        the batch (if vLLM pads it) get 0, as they are no request's."""
        if self._caps is None or self._caps.shape[0] != rows:
            caps = [UNCAPPED] * rows if self.caps is None else (self.caps + [0] * rows)[:rows]
            self._caps = torch.tensor(caps, dtype=torch.long, device=device)
        return self._caps

    def propose(self, *args: Any, **kwargs: Any) -> torch.Tensor | list[list[int]]:
        if not self.limiting:
            return self._propose(*args, **kwargs)
        if self.every_row_opted_out and not self.data_parallel:
            self.proposer._last_draft_probs = None
            return [[] for _ in self.caps]
        self.tokens, self.probs, self.lengths, self._caps = [], [], None, None
        try:
            drafts = self._propose(*args, **kwargs)
        except StopDrafting:
            drafts = torch.stack(self.tokens, dim=1)
            self.proposer._last_draft_probs = torch.stack(self.probs, dim=1).contiguous() if self.probs else None
        if self.lengths is None:  # no draft step ran (vLLM asked for 0 tokens)
            return drafts
        return [row[:n] for row, n in zip(drafts.tolist(), self.lengths.tolist())]


def limiter_of(proposer: Any) -> DraftLengthLimiter | None:
    """The limiter hooked into ``proposer``, if any (found even when something wrapped its
    ``propose`` again since)."""
    limiter = getattr(proposer, LIMITER_ATTRIBUTE, None)
    return limiter if isinstance(limiter, DraftLengthLimiter) else None
