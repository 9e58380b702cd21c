"""The two EDTrain schedules (Mask-p_t, Step-n_t) in both readings found in the wild.

* ``paper`` — the EDSD paper's equations, the default:
  Mask-p_t (Eq. 5) masks ``p_t = max(0, T - t - 1) * gamma`` percent (gamma = 3) of each
  sample's loss-masked positions, ranked by the target's full-vocabulary entropy;
  Step-n_t (Eq. 6) trains ``n_t = floor(1 + (S_max - 1) * t / (T - 1))`` TTT steps.
* ``specforge`` — SpecForge's ``specforge/core/edsd.py``, which trained the paper's drafters:
  the drop ratio is ``min(max((T - t - 1) * 0.02, 0), 0.4)``, ranked over all valid positions
  of the *batch* (loss-masked and target argmax inside the draft vocabulary) by the entropy
  of the target's distribution *restricted to the draft vocabulary*; ``n_t`` uses ``ceil``.

With T = 1 the single epoch uses S_max in both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SAMPLE, BATCH = "sample", "batch"
FULL_VOCAB, DRAFT_VOCAB = "full", "draft"


@dataclass(frozen=True)
class Reading:
    """One reading of EDTrain's schedules."""

    name: str
    gamma: float  # percent per remaining epoch
    cap: float | None  # largest masked percent, or None
    rounding: str  # "floor" or "ceil" in Eq. 6
    scope: str  # rank positions per SAMPLE or over the whole BATCH
    entropy_over: str  # FULL_VOCAB or DRAFT_VOCAB

    def mask_percent(self, epoch: int, epochs: int, gamma: float | None = None) -> float:
        """p_t in percent."""
        p = max(0, epochs - epoch - 1) * (self.gamma if gamma is None else gamma)
        return p if self.cap is None else min(p, self.cap)

    def ttt_steps(self, epoch: int, epochs: int, max_steps: int) -> int:
        """n_t of Eq. 6."""
        if epochs <= 1:
            return max_steps
        value = 1 + (max_steps - 1) * epoch / (epochs - 1)
        return math.ceil(value) if self.rounding == "ceil" else math.floor(value)


PAPER = Reading("paper", gamma=3.0, cap=None, rounding="floor", scope=SAMPLE, entropy_over=FULL_VOCAB)
SPECFORGE = Reading("specforge", gamma=2.0, cap=40.0, rounding="ceil", scope=BATCH, entropy_over=DRAFT_VOCAB)
READINGS = {r.name: r for r in (PAPER, SPECFORGE)}


def entropy_mask(entropy: torch.Tensor, eligible: torch.Tensor, percent: float, scope: str = SAMPLE) -> torch.Tensor:
    """``eligible`` with its top ``percent``% highest-entropy positions removed.

    ``scope`` SAMPLE ranks each row on its own and drops ``floor(percent/100 * n_row)``;
    BATCH ranks all eligible positions together and drops ``floor(percent/100 * n)``
    (SpecForge's ``int(drop_ratio * num_valid)``). Ties keep the later position.
    """
    keep = eligible.bool().clone()
    if percent <= 0:
        return keep
    groups = [keep[row] for row in range(keep.shape[0])] if scope == SAMPLE else [keep.view(-1)]
    values = [entropy[row] for row in range(entropy.shape[0])] if scope == SAMPLE else [entropy.reshape(-1)]
    for kept, ent in zip(groups, values):
        positions = torch.nonzero(kept).flatten()
        drop = math.floor(percent / 100 * len(positions))
        if drop:
            order = torch.argsort(ent[positions], descending=True, stable=True)
            kept[positions[order[:drop]]] = False
    return keep
