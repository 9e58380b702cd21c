"""Offline acceptance: what a drafter's chains would achieve on known greedy generations.

A serving engine drafts K tokens after the context x_0..x_c, the target accepts the leading
drafts that equal its own next tokens x_{c+1}.., adds one token of its own, and drafts again.
Given the whole greedy sequence, this replays that loop with any proposal function, so the
counts it predicts are the ones vLLM's ``vllm:spec_decode_*`` counters must show.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from vllm_edsd.serving.engine import SpecCounters
from .target import run_target


def replay(sequence: Sequence[int], prompt_len: int, k: int, chain_at: Callable[[int], Sequence[int]]) -> SpecCounters:
    """Replay greedy verification over ``sequence`` (prompt + generation).

    ``chain_at(c)`` returns the K drafts proposed when the context ends at index c.
    """
    counters = SpecCounters(accepted_per_pos=[0] * k)
    c = prompt_len  # the token sampled at prefill ends the first context
    while c < len(sequence) - 1:
        draft = list(chain_at(c))
        counters.drafts += 1
        counters.draft_tokens += k
        accepted = 0
        while accepted < k and c + 1 + accepted < len(sequence) and draft[accepted] == sequence[c + 1 + accepted]:
            counters.accepted_per_pos[accepted] += 1
            accepted += 1
        counters.accepted += accepted
        c += accepted + 1
    return counters


def total(counters: list[SpecCounters]) -> SpecCounters:
    out = SpecCounters(accepted_per_pos=[0] * len(counters[0].accepted_per_pos))
    for c in counters:
        out.drafts += c.drafts
        out.draft_tokens += c.draft_tokens
        out.accepted += c.accepted
        out.accepted_per_pos = [a + b for a, b in zip(out.accepted_per_pos, c.accepted_per_pos)]
    return out


@torch.no_grad()
def predict(drafter, target_model, generations: list[tuple[list[int], list[int]]], k: int) -> SpecCounters:
    """Counters the reference ``drafter`` predicts for (prompt, greedy output) pairs."""
    layer_ids = drafter.config.aux_layer_ids
    results = []
    for prompt, output in generations:
        sequence = prompt + output
        ids = torch.tensor([sequence])
        features = run_target(target_model, ids, layer_ids).features(layer_ids).to(next(drafter.parameters()).dtype)
        chains = drafter.propose(features[:, :-1], ids[:, 1:], k)[0]
        # Row p drafts after the context x_0..x_{p+1}: the context ending at c is row c - 1.
        results.append(replay(sequence, len(prompt), k, lambda c: chains[c - 1].tolist()))
    return total(results)
