"""Entropy-adaptive draft length: a request stops drafting where its drafter is unsure.

EDSD's premise is that tokens are rejected where entropy is high. With
``"adaptive_draft_length": true`` every draft step predicts the acceptance of the token just
drafted as ``exp(-H)``, the inverse of the drafter's perplexity there (H: the entropy, in nats,
of the drafter's distribution over its vocabulary, at temperature 1). A request whose
prediction falls below ``adaptive_draft_threshold`` stops drafting: its draft is cut before
that token, so verification checks only the tokens kept. When every request of the batch has
stopped, the remaining draft steps are skipped. Verification is vLLM's own, so the output is
unchanged (greedy: identical; sampled: the target's distribution).

This runs on vLLM's V1 model runner with synchronous scheduling, where drafts reach the
scheduler as one list per request (as the n-gram proposer's do), so vLLM schedules, verifies
and counts (``vllm:spec_decode_*``) exactly the tokens kept. It hooks one proposer instance:
its sampling step records the draft chain and applies the rule, and its ``propose`` returns
the cut lists. The entropy comes from the EDSD model's ``compute_logits``.
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


class _Carried(dict):
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
        return _Carried(threshold=self.threshold)

    @classmethod
    def of(cls, hf_config: Any) -> AdaptiveDraftLength | None:
        """The settings the plugin put on a drafter's hf_config, if any, validated again. A value
        of the same name read from the checkpoint's config.json is ignored with a warning:
        serving options come from the speculative config only."""
        raw = getattr(hf_config, CONFIG_ATTRIBUTE, None)
        if raw is None:
            return None
        if not isinstance(raw, _Carried):
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


def check_runner(use_v2_model_runner: bool, async_scheduling: bool) -> None:
    """The adaptive draft length needs vLLM's V1 runner and synchronous scheduling."""
    if use_v2_model_runner:
        raise EDSDError(
            f"{ENABLE!r} runs on vLLM's V1 model runner; this engine uses Model Runner V2: "
            "set VLLM_USE_V2_MODEL_RUNNER=0, or remove the field"
        )
    if async_scheduling:
        raise EDSDError(
            f"{ENABLE!r} needs synchronous scheduling (drafts of different lengths per request): "
            "pass --no-async-scheduling (async_scheduling=False), or remove the field"
        )


class StopDrafting(Exception):
    """Raised by the sampling hook when every request has stopped: ends ``propose`` early."""


class AdaptiveProposer:
    """Hooks one of vLLM's EAGLE proposers (V1) so that each request drafts only while its
    drafter is confident enough.

    vLLM's ``propose`` runs K draft steps and samples each through ``_sample_draft_tokens``;
    the hook there records the chain, updates each request's length and raises
    ``StopDrafting`` once none is still drafting. ``propose`` then returns one list per
    request, cut to its length. Under data parallelism the ranks agree on batch padding once
    before the draft loop, so the loop is only left from its second step on."""

    def __init__(self, proposer: Any, model: Any, settings: AdaptiveDraftLength, data_parallel: bool) -> None:
        self.proposer, self.model, self.settings = proposer, model, settings
        self.first_stop_step = 2 if data_parallel else 1
        self._propose, self._sample = proposer.propose, proposer._sample_draft_tokens
        self.tokens: list[torch.Tensor] = []
        self.probs: list[torch.Tensor] = []
        self.lengths: torch.Tensor | None = None
        proposer.propose = self.propose
        proposer._sample_draft_tokens = self.sample_draft_tokens

    def sample_draft_tokens(self, hidden_states: torch.Tensor, sampling_metadata: Any) -> tuple[torch.Tensor, Any]:
        tokens, probs = self._sample(hidden_states, sampling_metadata)
        entropy = self.model.last_draft_entropy
        assert entropy is not None and entropy.shape[0] == tokens.shape[0], "draft entropy was not recorded"
        still_drafting = entropy <= self.settings.max_entropy
        if self.lengths is None:
            self.lengths = still_drafting.long()
        else:  # a request that stopped stays stopped
            self.lengths += still_drafting & (self.lengths == len(self.tokens))
        self.tokens.append(tokens)
        if probs is not None:
            self.probs.append(probs)
        if len(self.tokens) >= self.first_stop_step and bool((self.lengths < len(self.tokens)).all()):
            raise StopDrafting
        return tokens, probs

    def propose(self, *args: Any, **kwargs: Any) -> torch.Tensor | list[list[int]]:
        self.tokens, self.probs, self.lengths = [], [], None
        try:
            drafts = self._propose(*args, **kwargs)
        except StopDrafting:
            drafts = torch.stack(self.tokens, dim=1)
            self.proposer._last_draft_probs = torch.stack(self.probs, dim=1).contiguous() if self.probs else None
        if self.lengths is None:  # no draft step ran (vLLM asked for 0 tokens)
            return drafts
        return [row[:n] for row, n in zip(drafts.tolist(), self.lengths.tolist())]
