"""The draft vocabulary: the most frequent target tokens among loss-masked positions
(SpecForge's recipe), as ``d2t`` offsets and a ``t2d`` membership mask."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import torch


def answer_token_counts(samples: Iterable[tuple[list[int], list[int]]]) -> Counter:
    """How often each token is a training target: the ids at loss-masked positions (what the
    drafter must propose), counted over rendered ``(ids, loss_mask)`` samples."""
    return Counter(t for ids, mask in samples for t, m in zip(ids[1:], mask[1:]) if m)


def coverage(t2d: torch.Tensor, counts: Counter) -> float:
    """The share of the counted tokens a draft vocabulary (``t2d``) holds: an upper bound on
    any drafter's acceptance at those positions."""
    total = sum(counts.values())
    return sum(n for token, n in counts.items() if t2d[token]) / total if total else 0.0


def build_vocab_mapping(counts: Counter, vocab_size: int, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d2t, t2d)``: draft id i is target id ``i + d2t[i]``; ``t2d[j]`` says j is drafted.

    Takes the ``draft_vocab_size`` most common ids (ties: lower id first); when fewer
    distinct ids were seen, pads with the lowest unused ids. Ids are sorted ascending.
    """
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    used = [token for token, _ in ranked[:draft_vocab_size]]
    chosen = set(used)
    filler = (i for i in range(vocab_size) if i not in chosen)
    while len(used) < draft_vocab_size:
        used.append(next(filler))
    ids = torch.tensor(sorted(used), dtype=torch.long)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(draft_vocab_size), t2d
