"""Prompt lookup beside the drafter: where a request's tokens so far end in an n-gram that
occurred earlier in them, the tokens that followed it are the draft; elsewhere the drafter's.

* **Keys.** vLLM's own ``ngram`` keys, ``prompt_lookup_min`` and ``prompt_lookup_max``, in an
  ``"edsd"`` or ``"eagle3"`` speculative config. vLLM zeroes them for model drafters, so the
  plugin takes them out before vLLM validates the config and puts them back on the
  ``SpeculativeConfig`` afterwards, where they travel to the workers with it. As with vLLM's
  ``ngram``, one key alone sets both.
* **Matching** is vLLM's n-gram proposer's rule (``find_match``): the longest n from max down
  to min whose last n tokens occurred earlier, its earliest occurrence, the tokens after it.
* **Choice** (``use_lookup``): the lookup drafts a row where it matched at least
  ``prompt_lookup_min`` tokens. The drafter still runs its first forward for every row (it
  writes the drafter's KV cache); rows the lookup serves get a drafter cap of 0, so the later
  draft steps end once the drafter's own rows are done (``draft_length.DraftLengthLimiter``).
* **Lengths.** ``num_speculative_tokens`` (K) is the most either source drafts;
  ``num_drafter_tokens`` (this plugin's key, at most K) caps the drafter's rows lower, so that
  the lookup's long drafts where the reply copies and the drafter's short ones elsewhere share
  one engine (on a CPU the drafter's later steps cost about what they save).
* **Caps** apply to both sources: a row's draft is at most its request's cap and this step's
  K; a cap-0 request gets nothing.
* **Counting.** The runner verifies each row's drafts on the next step; ``DraftSources``
  attributes that step's draft tokens and accepted tokens to the source that proposed them, so
  the two sources add up to vLLM's ``vllm:spec_decode_num_draft_tokens`` and
  ``..._num_accepted_tokens``. A worker logs them every ``LOG_INTERVAL_S`` seconds.

Verification is vLLM's own, so the output is unchanged. Like per-request caps, it needs the
V1 model runner with synchronous scheduling (drafts of different lengths per request).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from vllm_edsd.errors import EDSDError, positive_int
from vllm_edsd.serving.features.draft_length import Carried, limiter_of

logger = logging.getLogger("vllm.edsd")  # a child of vLLM's logger: its handlers and level

MIN_KEY, MAX_KEY = "prompt_lookup_min", "prompt_lookup_max"
VLLM_KEYS = (MIN_KEY, MAX_KEY)  # vLLM's own fields (its ngram's), which it zeroes for model drafters
DRAFTER_KEY = "num_drafter_tokens"  # the plugin's: the most the drafter drafts where the lookup does not
KEYS = (*VLLM_KEYS, DRAFTER_KEY)
# Where the drafter's length travels to the workers: an attribute of the drafter's hf_config,
# which vLLM pickles with the rest of the config (vLLM's SpeculativeConfig has no such field).
CONFIG_ATTRIBUTE = "edsd_lookup_drafter_tokens"
FEATURE = f"prompt lookup beside the drafter ({MIN_KEY!r}, {MAX_KEY!r})"
LOOKUP, DRAFTER = "lookup", "drafter"
LOG_INTERVAL_S = 10.0


def _check_length(key: str, value: Any) -> None:
    positive_int(value, f"speculative config: {key!r} (an n-gram length of the prompt lookup)")


@dataclass(frozen=True)
class PromptLookup:
    """The validated n-gram lengths the lookup matches, ``min_n`` to ``max_n`` tokens, and the
    most tokens the drafter drafts in the rows the lookup leaves to it (``drafter_tokens``;
    None: ``num_speculative_tokens``, the most either source drafts)."""

    min_n: int
    max_n: int
    drafter_tokens: int | None = None

    def __post_init__(self) -> None:
        for key, value in ((MIN_KEY, self.min_n), (MAX_KEY, self.max_n)):
            _check_length(key, value)
        if self.min_n > self.max_n:
            raise EDSDError(f"speculative config: {MIN_KEY!r} ({self.min_n}) must not exceed "
                            f"{MAX_KEY!r} ({self.max_n})")
        if self.drafter_tokens is not None:
            positive_int(self.drafter_tokens, f"speculative config: {DRAFTER_KEY!r} (the most tokens the drafter "
                                              "drafts where the lookup does not)")

    @classmethod
    def pop_from(cls, fields: dict[str, Any]) -> PromptLookup | None:
        """Remove the lookup keys from a speculative config dict and validate them; None when
        no n-gram length is given (or both are null). One length alone sets both, as in vLLM's
        ``ngram``."""
        given = {key: fields.pop(key) for key in KEYS if key in fields}
        for key in VLLM_KEYS:
            if given.get(key) is not None:
                _check_length(key, given[key])
        low, high, drafter = given.get(MIN_KEY), given.get(MAX_KEY), given.get(DRAFTER_KEY)
        if low is None and high is None:
            if drafter is not None:
                raise EDSDError(f"speculative config: {DRAFTER_KEY!r} limits the drafter beside the prompt lookup: "
                                f"it needs {MIN_KEY!r} and/or {MAX_KEY!r} (without them, lower "
                                "num_speculative_tokens instead)")
            return None
        return cls(high if low is None else low, low if high is None else high, drafter)

    def put_on(self, speculative_config: Any) -> None:
        """Set vLLM's own fields, which its ``__post_init__`` zeroed for a model drafter, and
        carry the drafter's length on its hf_config; refuse a drafter's length above K."""
        k = speculative_config.num_speculative_tokens
        if self.drafter_tokens is not None and self.drafter_tokens > k:
            raise EDSDError(f"speculative config: {DRAFTER_KEY!r} ({self.drafter_tokens}) must not exceed "
                            f"num_speculative_tokens ({k}), the most tokens either source drafts")
        speculative_config.prompt_lookup_min, speculative_config.prompt_lookup_max = self.min_n, self.max_n
        if self.drafter_tokens is not None:
            setattr(speculative_config.draft_model_config.hf_config, CONFIG_ATTRIBUTE,
                    Carried(drafter_tokens=self.drafter_tokens))

    @classmethod
    def of(cls, speculative_config: Any) -> PromptLookup | None:
        """The settings of a model drafter's speculative config (None: lookup off; vLLM leaves
        the fields 0 unless the plugin put them back)."""
        low = getattr(speculative_config, MIN_KEY, None)
        high = getattr(speculative_config, MAX_KEY, None)
        if not (low and high):
            return None
        draft_model = getattr(speculative_config, "draft_model_config", None)
        carried = getattr(getattr(draft_model, "hf_config", None), CONFIG_ATTRIBUTE, None)
        return cls(low, high, carried["drafter_tokens"] if isinstance(carried, Carried) else None)


@dataclass(frozen=True)
class Match:
    """An n-gram of ``length`` tokens at the end of the context that occurred earlier, and
    the tokens that followed that earlier occurrence (the lookup's proposal)."""

    length: int
    tokens: list[int]


def find_match(context: np.ndarray, min_n: int, max_n: int, k: int) -> Match | None:
    """vLLM's n-gram proposer's rule: the longest n in [min_n, max_n] whose last n tokens of
    ``context`` occur earlier in it, at their earliest occurrence, and the (at most ``k``)
    tokens after it. Unlike vLLM's matcher (which returns the tokens only) it says how long
    the match is, what a choice rule weighs.

    The candidates are the earlier positions holding the last token; each round keeps those
    whose match extends one token further back: one pass over the context, then at most
    ``max_n`` rounds over the candidates."""
    total = len(context)
    if k < 1 or total < 2:
        return None
    ends = np.flatnonzero(context[:-1] == context[-1])  # where an earlier match would end
    length = 1
    while ends.size and length < max_n:
        before = ends - length
        extends = before >= 0
        extends[extends] = context[before[extends]] == context[total - 1 - length]
        if not extends.any():
            break
        ends, length = ends[extends], length + 1
    if not ends.size or length < min_n:
        return None
    start = int(ends[0]) + 1
    return Match(length, context[start:start + k].tolist())


def use_lookup(match: Match | None, settings: PromptLookup) -> bool:
    """The choice rule: the lookup drafts where it matched at least ``prompt_lookup_min``
    tokens (elsewhere the drafter does). One place, to be weighed later against the drafter's
    confidence."""
    return match is not None and match.length >= settings.min_n and bool(match.tokens)


def _per_source() -> dict[str, int]:
    return {LOOKUP: 0, DRAFTER: 0}


@dataclass
class DraftSources:
    """Drafts (one per request and step) vLLM verified, their tokens, and the tokens accepted,
    per source of the drafts."""

    drafts: dict[str, int] = field(default_factory=_per_source)
    draft_tokens: dict[str, int] = field(default_factory=_per_source)
    accepted: dict[str, int] = field(default_factory=_per_source)

    def add(self, source: str, draft_tokens: int, accepted: int) -> None:
        self.drafts[source] += 1
        self.draft_tokens[source] += draft_tokens
        self.accepted[source] += accepted

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {source: {"drafts": self.drafts[source], "draft_tokens": self.draft_tokens[source],
                         "accepted": self.accepted[source]} for source in (LOOKUP, DRAFTER)}

    def describe(self) -> str:
        parts = []
        for source in (LOOKUP, DRAFTER):
            drafted, accepted = self.draft_tokens[source], self.accepted[source]
            rate = f" ({accepted / drafted:.1%})" if drafted else ""
            parts.append(f"{source} {drafted} draft tokens in {self.drafts[source]} drafts, {accepted} accepted{rate}")
        return "; ".join(parts)


def valid_sampled(sampled_token_ids: torch.Tensor | list[list[int]], vocab_size: int,
                  discarded: np.ndarray | None) -> list[list[int]]:
    """Each row's tokens of this step as the runner's bookkeeping keeps them: a tensor row
    loses its rejected slots (-1) and out-of-vocabulary padding, a discarded row (a partial
    prefill) everything."""
    if not isinstance(sampled_token_ids, torch.Tensor):
        return sampled_token_ids
    rows = [[t for t in row if 0 <= t < vocab_size] for row in sampled_token_ids.tolist()]
    if discarded is not None:
        for i in np.flatnonzero(discarded[:len(rows)]):
            rows[i] = []
    return rows


def row_contexts(input_batch: Any, sampled: list[list[int]], appended: bool) -> list[np.ndarray | None]:
    """Each row's tokens so far (prompt and output, this step's tokens included; None for a
    row that sampled nothing). A drafter that runs before the runner's bookkeeping (EAGLE's
    padded batch, handed a tensor) finds this step's tokens not yet in the token buffer; one
    that runs after it (handed lists) finds them there (``appended``)."""
    contexts: list[np.ndarray | None] = []
    for i, tokens in enumerate(sampled):
        if not tokens:
            contexts.append(None)
            continue
        known = input_batch.token_ids_cpu[i, :int(input_batch.num_tokens_no_spec[i])]
        contexts.append(known if appended else np.concatenate([known, np.asarray(tokens, dtype=known.dtype)]))
    return contexts


class LookupDrafting:
    """One worker's lookup: matches each row before its drafter runs, merges the drafts, and
    counts what the next step verifies by source (``sources``: req_id -> source of the drafts
    that request was handed last)."""

    def __init__(self, settings: PromptLookup) -> None:
        self.settings = settings
        self.counts = DraftSources()
        self.sources: dict[str, str] = {}
        self._logged_at, self._logged = time.monotonic(), DraftSources().as_dict()

    def count_verified(self, req_ids: list[str], num_draft_tokens: list[int] | None,
                       sampled: list[list[int]]) -> None:
        """Attribute this step's verification (each row's scheduled drafts, and the tokens it
        kept beyond the target's own) to the source of that row's drafts."""
        for req_id, drafted, tokens in zip(req_ids, num_draft_tokens or [], sampled):
            if drafted and tokens:
                self.counts.add(self.sources.get(req_id, DRAFTER), drafted, len(tokens) - 1)
        self._maybe_log()

    def before_drafting(self, runner: Any, arguments: dict[str, Any], caps: list[int]) -> list[Match | None]:
        """Count the verification of this step, then match every row of the batch (the V1
        runner's ``propose_draft_token_ids`` arguments, each row's request cap)."""
        batch, sampled_ids = runner.input_batch, arguments["sampled_token_ids"]
        discarded = getattr(getattr(runner, "discard_request_mask", None), "np", None)
        sampled = valid_sampled(sampled_ids, batch.vocab_size, discarded)
        metadata = arguments.get("spec_decode_metadata")
        self.count_verified(batch.req_ids, None if metadata is None else metadata.num_draft_tokens, sampled)
        contexts = row_contexts(batch, sampled, appended=not isinstance(sampled_ids, torch.Tensor))
        k = getattr(arguments.get("scheduler_output"), "num_spec_tokens_to_schedule", max(caps, default=0))
        limits = [0 if ctx is None else min(cap, k, runner.max_model_len - len(ctx))
                  for ctx, cap in zip(contexts, caps)]
        return self.match_rows(contexts, limits)

    def drafter_caps(self, matches: list[Match | None], caps: list[int], k: int) -> list[int] | None:
        """Each row's drafter cap: 0 where the lookup drafts, else its cap within the drafter's
        own length; None where that leaves every row at K (the drafter's loop is vLLM's own)."""
        own = min(k, self.settings.drafter_tokens or k)
        drafter = [0 if match is not None else min(cap, own) for match, cap in zip(matches, caps)]
        return None if all(cap == k for cap in drafter) else drafter

    def after_drafting(self, runner: Any, drafts: torch.Tensor | list[list[int]],
                       matches: list[Match | None]) -> torch.Tensor | list[list[int]]:
        """The drafts the runner hands on: the lookup's in the rows it serves (with one-hot
        draft probabilities where the drafter's are kept for the rejection sampler)."""
        drafts = self.merge(runner.input_batch.req_ids, drafts, matches)
        probs = getattr(runner, "_draft_probs", None)
        if probs is not None and any(m is not None for m in matches):
            runner._draft_probs = one_hot_rows(probs, matches)
        return drafts

    def match_rows(self, contexts: list[np.ndarray | None], limits: list[int]) -> list[Match | None]:
        """Each row's match where the choice rule picks the lookup (None: the drafter drafts);
        ``limits``: the most tokens each row may draft (0: none, no lookup)."""
        s = self.settings
        matches = [None if ctx is None or limit < 1 else find_match(ctx, s.min_n, s.max_n, limit)
                   for ctx, limit in zip(contexts, limits)]
        return [m if use_lookup(m, s) else None for m in matches]

    def merge(self, req_ids: list[str], drafts: torch.Tensor | list[list[int]],
              matches: list[Match | None]) -> list[list[int]]:
        """The drafter's drafts with the lookup's in the rows it serves (the drafter's own,
        untouched, where it serves every row); records each row's source."""
        self.sources = {req_id: DRAFTER if match is None else LOOKUP for req_id, match in zip(req_ids, matches)}
        if all(match is None for match in matches):
            return drafts
        rows = drafts.tolist() if isinstance(drafts, torch.Tensor) else [list(row) for row in drafts]
        for i, match in enumerate(matches):
            if match is not None:
                rows[i] = list(match.tokens)
        return rows

    def _maybe_log(self) -> None:
        now, counts = time.monotonic(), self.counts.as_dict()
        if now - self._logged_at >= LOG_INTERVAL_S and counts != self._logged:
            logger.info("vllm-edsd: draft sources so far: %s", self.counts.describe())
            self._logged_at, self._logged = now, counts


def one_hot_rows(probs: torch.Tensor, matches: list[Match | None]) -> torch.Tensor:
    """Draft probabilities ``[rows, steps, vocab]`` in which each lookup row is one-hot on its
    tokens (a proposal without sampling: the rejection sampler then accepts a token with the
    target's probability of it), widened to the longest draft."""
    width = max([probs.shape[1], *(len(m.tokens) for m in matches if m is not None)])
    if width > probs.shape[1]:
        probs = torch.cat([probs, probs.new_zeros(probs.shape[0], width - probs.shape[1], probs.shape[2])], dim=1)
    for row, match in enumerate(matches):
        if match is not None and row < probs.shape[0]:
            probs[row] = 0
            probs[row, torch.arange(len(match.tokens)), torch.tensor(match.tokens)] = 1
    return probs


WORKER_METHOD = "edsd_draft_source_counts"  # LLM.collective_rpc(WORKER_METHOD): every worker's counts


def draft_source_counts(worker: Any) -> dict[str, dict[str, int]] | None:
    """A worker's counts per source, as its method ``WORKER_METHOD``; None where the worker
    drafts without a prompt lookup."""
    limiter = limiter_of(getattr(worker.model_runner, "drafter", None))
    return None if limiter is None or limiter.lookup is None else limiter.lookup.counts.as_dict()


def add_worker_method() -> None:
    """``draft_source_counts`` as a method of vLLM's workers, so that ``collective_rpc`` calls it
    by name: vLLM sends a function to an engine core in another process (its default) only by
    pickle, which it allows only with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``."""
    from vllm.v1.worker.worker_base import WorkerBase

    setattr(WorkerBase, WORKER_METHOD, draft_source_counts)
