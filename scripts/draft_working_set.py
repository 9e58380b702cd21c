"""How fast a CPU reads a draft step's weights, by how much of them there is.

``python scripts/draft_working_set.py [--threads 1]``

A batch-1 draft step reads every weight of the draft layer and the draft vocabulary's head
once; between two target forwards vLLM runs K such steps back to back. Here each drafter's
weights at the demo target's shapes (hidden 576, FFN 1536, draft vocabulary 4,096) are float32
matrices, random, multiplied by one row each, as a step would:

* EAGLE-3's draft layer (q/k/v over [u; e], o, the MLP) and head;
* EDSD's, with EDFuse at the FFN width (1536, the shipped drafters') on top;
* EDSD's with EDFuse at the target's width (576, the paper's "no extra parameters" variant).

"hot": steps back to back, the weights left in the caches by the step before (steps 2..K);
"cold": after 64 MiB of other data went through (step 1, after the target's forward). A
working set larger than the last-level cache reads from memory in both, so its hot step costs
about its cold one. Prints MiB, ms per step and GiB/s for each.
"""

from __future__ import annotations

import argparse
import time

import torch

HIDDEN, FFN, VOCAB = 576, 1536, 4096
ATTENTION = [(HIDDEN, 2 * HIDDEN), (192, 2 * HIDDEN), (192, 2 * HIDDEN), (HIDDEN, HIDDEN)]
MLP = [(FFN, HIDDEN), (FFN, HIDDEN), (HIDDEN, FFN)]
DRAFTERS = {
    "EAGLE-3": ATTENTION + MLP + [(VOCAB, HIDDEN)],
    "EDSD, EDFuse 1536": ATTENTION + MLP + [(FFN, HIDDEN), (FFN, HIDDEN), (HIDDEN, FFN)] + [(VOCAB, HIDDEN)],
    "EDSD, EDFuse 576": ATTENTION + MLP + [(HIDDEN, HIDDEN)] * 3 + [(VOCAB, HIDDEN)],
}


def step_ms(weights: list[torch.Tensor], flush: torch.Tensor | None, steps: int) -> float:
    """The median ms of one step (each weight times one row), after ``flush`` went through."""
    rows = {w.shape[1]: torch.randn(1, w.shape[1]) for w in weights}
    times = []
    for _ in range(steps):
        if flush is not None:
            flush.add_(1.0)
        began = time.perf_counter()
        for w in weights:
            torch.nn.functional.linear(rows[w.shape[1]], w)
        times.append(time.perf_counter() - began)
    return 1000 * sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: vLLM's worker on 2 cores)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    flush = torch.randn(64 * 2**20 // 4)
    print(f"float32, batch 1, {args.threads} thread(s)")
    for name, shapes in DRAFTERS.items():
        weights = [torch.randn(out, into) for out, into in shapes]
        mib = sum(w.numel() for w in weights) * 4 / 2**20
        step_ms(weights, None, 20)  # warm-up
        hot, cold = step_ms(weights, None, 300), step_ms(weights, flush, 60)
        print(f"{name:18s} {mib:5.1f} MiB   hot {hot:.3f} ms ({mib / 1024 / hot * 1e3:5.1f} GiB/s)"
              f"   cold {cold:.3f} ms ({mib / 1024 / cold * 1e3:5.1f} GiB/s)")


if __name__ == "__main__":
    main()
