"""EDSelect's pass over the calibration set: every layer's statistics, streamed, and its scores."""

from __future__ import annotations

import math

import torch
from tqdm import tqdm

from vllm_edsd.features.hidden_states import decoder_of, fingerprint, run_target

from . import metrics

TOKENS_FOR_ENTROPY = 4096
STATISTICS_BUDGET = 2 * 2**30  # bytes of layer statistics held at once (Llama-3.1-8B: 6 layers per pass)


def score_layers(
    model, sequences: list[list[int]], seed: int, device: str, memory_budget: int = STATISTICS_BUDGET
) -> dict[int, dict[str, float]]:
    """Curvature, LiDAR and matrix entropy for layer ids 1..N, streamed one sequence at a time.

    Each layer's statistics are two D×D float64 matrices and a fixed sample of token states
    (``metrics.LayerStatistics``); the layers are scored in groups that fit ``memory_budget``
    bytes, one pass over the calibration set per group (the same perturbations in every pass),
    so memory depends on neither the number of sequences nor the number of layers.
    """
    n = len(decoder_of(model).layers)
    width, vocab = fingerprint(model).hidden_size, fingerprint(model).vocab_size
    per_layer = 2 * width * width * 8 + TOKENS_FOR_ENTROPY * width * 4
    group = max(1, min(n, memory_budget // per_layer))
    per_token = max(1, TOKENS_FOR_ENTROPY // len(sequences))
    scores: dict[int, dict[str, float]] = {}
    bar = tqdm(total=len(sequences) * math.ceil(n / group), desc="calibration", unit="sample")
    for first in range(1, n + 1, group):
        layer_ids = tuple(range(first, min(n, first + group - 1) + 1))
        bar.set_postfix(layers=f"{layer_ids[0]}-{layer_ids[-1]}")
        generator = torch.Generator().manual_seed(seed)
        stats = {layer: metrics.LayerStatistics(width, TOKENS_FOR_ENTROPY) for layer in layer_ids}
        for ids in sequences:
            base = torch.tensor([ids])
            variants = torch.cat([base] + [metrics.perturb(base, vocab, generator)
                                           for _ in range(metrics.PERTURB_COPIES)])
            out = run_target(model, variants.to(device), layer_ids, outputs=False)
            picks = torch.randperm(len(ids), generator=generator)[:per_token]
            for layer in layer_ids:
                stats[layer].add(out.aux[layer].cpu(), picks)
            bar.update()
        scores.update({layer: stats[layer].scores() for layer in layer_ids})
        del stats
    bar.close()
    return scores
