"""``edsd train`` as a call: ``run(TrainOptions)``, which the command and the pipeline both call.
Under torchrun every process is ``python -m vllm_edsd train ...``, so the command stays the
entry of data-parallel training; an in-process call is one process, or one rank of a process
group already set up by torchrun's environment (``distributed.connect``)."""

from __future__ import annotations

from pathlib import Path

from .distributed import connect
from .job import prepare
from .options import TrainOptions
from .trainer import train


def run(options: TrainOptions) -> list[dict]:
    """Train one drafter into ``options.out`` (resuming an interrupted run there): a checkpoint
    after every epoch and ``final``; the log of the epochs."""
    out = Path(options.out)
    options = options.on_device()
    with connect(options.device, options.data_parallel) as (world, device):
        job = prepare(options, world, device)
        log = train(job.model, job.shards, job.draft_head, job.recipe, out, lambda m, d: m.save_pretrained(d),
                    job.columns, world, options.save_every)
    if world.main:
        last = log[-1]
        print(f"done: {len(log)} epochs, final loss {last['loss']:.3f}, accuracy per step "
              + ", ".join(f"{a:.2f}" for a in last["acc_per_step"]) + f"\ncheckpoint: {out / 'final'}")
    return log
