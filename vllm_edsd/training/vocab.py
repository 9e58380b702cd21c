"""The draft vocabulary: the most frequent target tokens among loss-masked positions
(SpecForge's recipe), as ``d2t`` offsets and a ``t2d`` membership mask."""

from __future__ import annotations

from collections import Counter

import torch


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
