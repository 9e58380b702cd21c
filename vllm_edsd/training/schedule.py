"""The two EDTrain schedules (paper Eqs. 5 and 6) and the entropy mask.

* Mask-p_t: in epoch t of T, mask the ``p_t = max(0, T - t - 1) * gamma`` percent of
  loss-masked positions whose target entropy is highest (easy tokens first).
* Step-n_t: ``n_t = floor(1 + (S_max - 1) * t / (T - 1))`` training-time-test steps in
  epoch t (a short horizon first); with T = 1 the single epoch uses S_max.
"""

from __future__ import annotations

import math

import torch


def mask_percent(epoch: int, epochs: int, gamma: float) -> float:
    """p_t of Eq. 5, in percent."""
    return max(0, epochs - epoch - 1) * gamma


def ttt_steps(epoch: int, epochs: int, max_steps: int) -> int:
    """n_t of Eq. 6."""
    if epochs == 1:
        return max_steps
    return math.floor(1 + (max_steps - 1) * epoch / (epochs - 1))


def entropy_mask(entropy: torch.Tensor, loss_mask: torch.Tensor, percent: float) -> torch.Tensor:
    """``loss_mask`` with the top ``percent``% highest-entropy loss-masked positions removed,
    per sample (row). The count is ``floor(percent/100 * n)`` of the row's n loss-masked
    positions; ties are broken towards later positions being kept."""
    keep = loss_mask.bool().clone()
    if percent <= 0:
        return keep
    for row in range(entropy.shape[0]):
        positions = torch.nonzero(keep[row]).flatten()
        drop = math.floor(percent / 100 * len(positions))
        if drop:
            order = torch.argsort(entropy[row, positions], descending=True, stable=True)
            keep[row, positions[order[:drop]]] = False
    return keep
