"""Greedy drafts chosen in the drafter's own vocabulary.

An EAGLE-3 or EDSD drafter predicts over a draft vocabulary (4,096 tokens for the demo pair)
that ``d2t`` maps into the target's (49,152 for the demo target). To draft the argmax, vLLM's
proposer asks the model for logits over the *target's* vocabulary: vLLM's EAGLE-3 model fills a
row of the target's size with ``-inf``, scatters the draft logits into it, and the proposer
takes the argmax over the whole row, on every draft step (``SpecDecodeBaseProposer._greedy_sample``,
``Eagle3LlamaForCausalLM.compute_logits``).

The argmax of the draft logits, mapped through ``d2t``, is the same token: the scattered row
holds those logits and ``-inf`` elsewhere, and the draft vocabulary lies in ascending target
order (as SpecForge and ``edsd convert`` write ``d2t``), so even a tie resolves to the same
token. ``hook`` replaces the proposer's greedy sampler on the instance with
``DraftVocabArgmax``, which skips the full row, for both methods. Sampled
drafts (``draft_sample_method: probabilistic`` at temperature > 0) keep vLLM's path: their
probabilities must span the target's vocabulary for the rejection sampler.
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


class DraftVocabArgmax:
    """The proposer's ``_greedy_sample``: the argmax over the draft vocabulary, mapped to the
    target's ids. Falls back to vLLM's own where the logits processor hands this rank none."""

    def __init__(self, model: Any, greedy_sample: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.model, self.greedy_sample = model, greedy_sample

    def __call__(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = draft_vocab_logits(self.model, hidden_states)
        if logits is None:
            return self.greedy_sample(hidden_states)
        draft_ids = logits.argmax(dim=-1)
        return draft_ids + self.model.draft_id_to_target_id[draft_ids]


def hook(proposer: Any, model: Any) -> bool:
    """Draft the argmax in the draft vocabulary where the drafter has one of its own and vLLM's
    proposer would scatter it; whether it did. Left to vLLM: a drafter over the target's whole
    vocabulary, vLLM's local argmax reduction and heterogeneous vocabularies (their own paths)."""
    if getattr(model, "draft_id_to_target_id", None) is None or not hasattr(model, "lm_head"):
        return False
    if getattr(proposer, "use_local_argmax_reduction", False) or getattr(proposer, "use_heterogeneous_vocab", False):
        return False
    proposer._greedy_sample = DraftVocabArgmax(model, proposer._greedy_sample)
    return True
