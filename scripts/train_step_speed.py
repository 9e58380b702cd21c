"""How fast one EDTrain optimizer step runs in float32 and under ``--autocast bfloat16``, at the
shipped EDSD drafter's shapes (random weights and features, the demo's draft vocabulary).

Alternates the two modes so that drift on a shared machine falls on both; prints each mode's
seconds per batch and positions per second (its fastest batch after a warm-up one).

    python scripts/train_step_speed.py [--ttt-steps 4] [--batch-size 4] [--length 360] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # vllm_edsd, from a checkout

from vllm_edsd.methods.edsd.config import EDSDConfig  # noqa: E402
from vllm_edsd.methods.edsd.model import EDSDDraftModel  # noqa: E402
from vllm_edsd.training.fitter import Fitter  # noqa: E402
from vllm_edsd.training.recipe import Recipe  # noqa: E402

DRAFTER = Path(__file__).resolve().parents[1] / "vllm_edsd" / "assets" / "demo" / "edsd" / "config.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ttt-steps", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--length", type=int, default=360, help="tokens per sample")
    parser.add_argument("--rounds", type=int, default=2, help="alternations of the two modes")
    args = parser.parse_args()
    cfg = EDSDConfig.from_dict(json.loads(DRAFTER.read_text()))
    torch.manual_seed(0)
    model = EDSDDraftModel(cfg)
    draft_vocab, width, shape = cfg.draft_vocab_size, cfg.hidden_size, (args.batch_size, args.length)
    with torch.no_grad():
        model.t2d.zero_()
        model.t2d[:draft_vocab] = True
    batch = {"input_ids": torch.randint(0, draft_vocab, shape), "loss_mask": torch.ones(shape, dtype=torch.bool),
             "aux": torch.randn(*shape, 2 * cfg.target_hidden_size), "final": torch.randn(*shape, width),
             "target_argmax": torch.randint(0, draft_vocab, shape), "target_entropy": torch.rand(shape)}
    fitters = {mode: Fitter(model, torch.randn(draft_vocab, width) * 0.05, Recipe(autocast=autocast))
               for mode, autocast in (("float32", None), ("bfloat16 autocast", "bfloat16"))}
    for _ in range(args.rounds):
        for mode, fitter in fitters.items():
            times = []
            for _ in range(4):
                start = time.perf_counter()
                fitter.step(batch, args.ttt_steps, 0.0, 1e-5)
                times.append(time.perf_counter() - start)
            print(f"{mode:>18}: {' '.join(f'{t:.2f}' for t in times)} s/batch, "
                  f"{args.batch_size * args.length / min(times[1:]):.0f} positions/s", flush=True)


if __name__ == "__main__":
    main()
