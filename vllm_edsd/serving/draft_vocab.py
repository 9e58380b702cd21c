"""Drafts chosen in the drafter's own vocabulary, greedy and sampled.

An EAGLE-3 or EDSD drafter predicts over a draft vocabulary (4,096 tokens for the demo pair)
that ``d2t`` maps into the target's (49,152 for the demo target). vLLM's proposer samples each
draft step (``SpecDecodeBaseProposer._sample_draft_tokens``) from logits over the *target's*
vocabulary: vLLM's EAGLE-3 model fills a row of the target's size with ``-inf`` and scatters the
draft logits into it (``Eagle3LlamaForCausalLM.compute_logits``); the proposer then takes the
argmax over the whole row (greedy drafts) or divides it by the temperature, softmaxes it, gives
it exponential noise and copies it (``draft_sample_method: probabilistic`` at temperature > 0),
every entry outside the draft vocabulary carrying probability 0.

``hook`` replaces that sampler on the instance with ``DraftVocabSampling``, for both methods: vLLM's
own ``_sample_from_logits`` on the draft vocabulary's logits, the tokens mapped through ``d2t``, and
sampled drafts' probabilities placed in a zeroed row of the target's size, which the rejection
sampler reads. The greedy draft is the same token (the draft vocabulary lies in ascending target
order, as SpecForge and ``edsd convert`` write ``d2t``, so even a tie resolves alike); sampled
drafts have the same distribution and the same probabilities up to float rounding of the softmax's
sum, with the softmax and noise over 4,096 entries instead of 49,152 for the demo pair
(docs/results.md: 4.3 against 1.05 ms of a decode step at T=1, K=4).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def draft_vocab_logits(model: Any, hidden_states: torch.Tensor) -> torch.Tensor | None:
    """The drafter's logits over its own vocabulary: the model's ``draft_vocab_logits`` where it
    has one (EDSD's, which also records the draft entropy), else its head through its logits
    processor (vLLM's EAGLE-3 model), as ``compute_logits`` computes them before scattering."""
    own = getattr(model, "draft_vocab_logits", None)
    return own(hidden_states) if own is not None else model.logits_processor(model.lm_head, hidden_states)


class DraftVocabSampling:
    """The proposer's ``_sample_draft_tokens``: vLLM's sampling of drafts (the argmax, or with the
    request's temperature, by its ``_sample_from_logits``) over the draft vocabulary, mapped to
    the target's ids, with sampled drafts' probabilities placed in a row of the target's
    vocabulary. Falls back to vLLM's own where the logits processor hands this rank none."""

    def __init__(self, proposer: Any, model: Any, sample_draft_tokens: Callable) -> None:
        self.proposer, self.model, self.sample_draft_tokens = proposer, model, sample_draft_tokens
        self.vocab_size = model.config.vocab_size
        offsets = model.draft_id_to_target_id
        self.target_ids = torch.arange(len(offsets), device=offsets.device) + offsets

    def __call__(self, hidden_states: torch.Tensor, sampling_metadata: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        logits = draft_vocab_logits(self.model, hidden_states)
        if logits is None:
            return self.sample_draft_tokens(hidden_states, sampling_metadata)
        draft_ids, draft_probs = self.proposer._sample_from_logits(logits, sampling_metadata)
        target_ids = self.target_ids[draft_ids]
        if draft_probs is None:  # greedy drafts: vLLM's rejection sampler needs no probabilities
            return target_ids, None
        probs = draft_probs.new_zeros(draft_probs.shape[0], self.vocab_size)
        probs.index_copy_(1, self.target_ids, draft_probs)
        return target_ids, probs


def hook(proposer: Any, model: Any) -> bool:
    """Sample every draft step in the draft vocabulary (``_sample_draft_tokens``) where the
    drafter has one of its own and vLLM's proposer would scatter it; whether it did. Left to
    vLLM: a drafter over the target's whole vocabulary, vLLM's local argmax reduction and
    heterogeneous vocabularies (their own paths)."""
    if getattr(model, "draft_id_to_target_id", None) is None or not hasattr(model, "lm_head"):
        return False
    if getattr(proposer, "use_local_argmax_reduction", False) or getattr(proposer, "use_heterogeneous_vocab", False):
        return False
    proposer._sample_draft_tokens = DraftVocabSampling(proposer, model, proposer._sample_draft_tokens)
    return True
