"""Offline acceptance: what a drafter's chains would achieve on known greedy generations.

A serving engine drafts K tokens after the context x_0..x_c, the target accepts the leading
drafts that equal its own next tokens x_{c+1}.., adds one token of its own, and drafts again.
Given the whole greedy sequence, this replays that loop with any proposal function, so the
counts it predicts are the ones vLLM's ``vllm:spec_decode_*`` counters must show.

At temperature > 0 with sampled drafts, vLLM's rejection sampler accepts a first draft drawn
from the drafter's q with probability Σ_x min(p(x), q(x)) (p: the target's distribution);
``first_draft_acceptance`` computes that for every context of a sequence.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from vllm_edsd.features.hidden_states import run_target
from vllm_edsd.launch.engine import SpecCounters


def replay(sequence: Sequence[int], prompt_len: int, k: int, chain_at: Callable[[int], Sequence[int]]) -> SpecCounters:
    """Replay greedy verification over ``sequence`` (prompt + generation).

    ``chain_at(c)`` returns the drafts (at most K; fewer where the draft length is adaptive)
    proposed when the context ends at index c. As in vLLM, a step without drafts counts no draft.
    """
    counters = SpecCounters(accepted_per_pos=[0] * k)
    c = prompt_len  # the token sampled at prefill ends the first context
    while c < len(sequence) - 1:
        draft = list(chain_at(c))
        counters.drafts += bool(draft)
        counters.draft_tokens += len(draft)
        accepted = 0
        while (
            accepted < len(draft) and c + 1 + accepted < len(sequence) and draft[accepted] == sequence[c + 1 + accepted]
        ):
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


def kept_lengths(entropy: torch.Tensor, max_entropy: float | None) -> torch.Tensor:
    """How many leading drafts of each chain the adaptive draft length keeps: those before
    the first whose entropy exceeds ``max_entropy`` (all of them when it is None)."""
    confident = torch.ones_like(entropy, dtype=torch.bool) if max_entropy is None else entropy <= max_entropy
    return confident.long().cumprod(-1).sum(-1)


@torch.no_grad()
def predict(drafter, target_model, generations: list[tuple[list[int], list[int]]], k: int,
            max_entropy: float | None = None, caps: Sequence[int] | None = None) -> SpecCounters:
    """Counters the reference ``drafter`` predicts for (prompt, greedy output) pairs; with
    ``max_entropy``, under the adaptive draft length; with ``caps``, each generation's drafts
    at most its cap long (a per-request draft length, ``serving/features/draft_length.py``)."""
    layer_ids = drafter.aux_layer_ids
    results = []
    for i, (prompt, output) in enumerate(generations):
        sequence = prompt + output
        ids = torch.tensor([sequence])
        features = run_target(target_model, ids, layer_ids).features(layer_ids).to(next(drafter.parameters()).dtype)
        chains, entropy = drafter.propose_with_entropy(features[:, :-1], ids[:, 1:], k)
        lengths = kept_lengths(entropy[0], max_entropy).clamp(max=k if caps is None else caps[i]).tolist()
        # Row p drafts after the context x_0..x_{p+1}: the context ending at c is row c - 1.
        results.append(replay(sequence, len(prompt), k, lambda c: chains[0, c - 1, :lengths[c - 1]].tolist()))  # noqa: B023 (called at once)
    return total(results)


@torch.no_grad()
def first_draft_acceptance(drafter, target_model, sequence: Sequence[int], temperature: float = 1.0) -> torch.Tensor:
    """For each context x_0..x_{p+1} of ``sequence`` (row p, as in ``predict``), the
    probability that a first draft sampled from the drafter at ``temperature`` is accepted:
    Σ_x min(p_target(x), q_draft(x)), both distributions at ``temperature``."""
    layer_ids = drafter.aux_layer_ids
    ids = torch.tensor([list(sequence)])
    outputs = run_target(target_model, ids, layer_ids)
    features = outputs.features(layer_ids).to(next(drafter.parameters()).dtype)
    q = torch.softmax(drafter.first_draft_logits(features[:, :-1], ids[:, 1:]).float() / temperature, -1)
    p = torch.softmax(outputs.logits[:, 1:] / temperature, -1)
    draft_vocab = torch.arange(q.shape[-1])
    p_on_draft_vocab = p[..., drafter.draft_to_target(draft_vocab)]
    return torch.minimum(p_on_draft_vocab, q).sum(-1)[0]
