"""EDTrain's loop: epochs of optimizer steps over the feature shards, a checkpoint, the
training state and a log line after each, resumable (``checkpointing``); the loss is
``loss.ttt_loss``, the step ``fitter.Fitter``."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from itertools import islice
from pathlib import Path

import torch
from tqdm import tqdm

from vllm_edsd.errors import EDSDError
from vllm_edsd.features.shards import SHARD_SIZE, batch_count, iterate_batches, join_batches, shard_samples

from .checkpointing import STATE_FILE, Progress, gathered_state, resume, write_state
from .distributed import SINGLE, World
from .fitter import Fitter
from .recipe import Recipe

LOG_FILE = "train_log.jsonl"


def count_batches(shards: list[Path], batch_size: int) -> int:
    """How many batches ``iterate_batches`` makes of ``shards`` (from their headers alone)."""
    return sum(batch_count(shard_samples(path), batch_size) for path in shards)


def epoch_batches(
    shards: list[Path], batch_size: int, generators: list[torch.Generator], columns: torch.Tensor | None,
    ranks: list[int], world_size: int, steps: int | None, skip: int = 0,
) -> Iterator[dict[str, torch.Tensor]]:
    """One epoch's batches of ``ranks`` (rank r reads ``shards[r::world_size]`` in the order of
    ``generators[i]``), the first ``steps`` of each (all with None), batch i of every rank
    joined into one, from batch ``skip`` on (an epoch resumed mid-way). A training process
    passes its own rank; ``ranks`` = all of them gives the union batches that one process
    trains on to equal a data-parallel run."""
    left = None if steps is None else max(steps - skip, 0)
    parts = [islice(iterate_batches(shards[rank::world_size], batch_size, generator, columns, skip), left)
             for rank, generator in zip(ranks, generators)]
    for batches in zip(*parts):
        yield batches[0] if len(batches) == 1 else join_batches(list(batches))


def _union_sums(sums: dict, world: World) -> dict:
    """An epoch's sums over every rank: loss and accuracies averaged (each rank's are scaled to
    the union's count, ``ttt_loss``), position counts added."""
    if world.size == 1:
        return sums
    n = len(sums["acc"])
    flat = [sums["loss"], *sums["acc"], sums["masked"], sums["eligible"], sums["counted"]]
    total = world.sum(torch.tensor(flat, dtype=torch.float64)).tolist()
    return {"loss": total[0] / world.size, "batches": sums["batches"],
            "acc": [a / world.size for a in total[1 : 1 + n]],
            **{key: int(value) for key, value in zip(("masked", "eligible", "counted"), total[1 + n :])}}


def train(
    model,
    shards: list[Path],
    draft_head: torch.Tensor,
    recipe: Recipe,
    out_dir: Path,
    save_checkpoint,
    columns: torch.Tensor | None = None,
    world: World = SINGLE,
    save_every: int = 0,
) -> list[dict]:
    """Train for ``recipe.epochs`` epochs, writing a checkpoint and a log line after each.

    Resumes from ``out_dir/training_state.pt`` when an earlier run was interrupted: after its
    last finished epoch, or, with ``save_every`` > 0 (the state is also saved every that many
    batches), where the epoch in progress was last saved, to the same result.
    ``save_checkpoint(model, directory)`` writes one checkpoint in the method's layout;
    ``columns`` picks the drafter's layers from shards stored for more (``features.aux_columns``).

    Data-parallel (``world.size`` > 1): rank r trains on ``shards[r::size]``, shuffled by a
    generator seeded ``seed + r`` (rank 0's order is the one-process run's). Every rank stops
    each epoch after the smallest rank's batch count (counted once, before the first epoch), so
    all take the same optimizer steps; a longer rank's last batches of that epoch's order are
    skipped. Loss and gradients equal one process's on the union of the ranks' batches
    (``ttt_loss``), except the ``specforge`` reading's entropy ranking, which ranks over each
    rank's own batch. Only rank 0 prints, writes checkpoints, the state and the log, all of
    full tensors whatever ``world.data_parallel`` (FSDP's shards are gathered first); the state
    holds every rank's shuffling and RNG states, so a resume with as many processes and the
    same parallelism continues exactly (otherwise it is refused).
    """
    if len(shards) < world.size:
        raise EDSDError(f"{len(shards)} feature shard(s) for {world.size} training processes: each needs at least "
                        f"one ({SHARD_SIZE} samples per shard); use fewer processes or more samples")
    run = _Run(Fitter(model, draft_head, recipe, world), world, shards, columns, out_dir, save_checkpoint, save_every)
    progress = run.start()
    for epoch in range(progress.epoch, recipe.epochs):
        run.epoch(epoch, progress if epoch == progress.epoch else None)
    run.finish()
    return run.log


class _Run:
    """One call of ``train``: the drafter's fitter, the data and its order, where the run
    writes, and the log of its epochs."""

    def __init__(self, fitter: Fitter, world: World, shards: list[Path], columns: torch.Tensor | None,
                 out_dir: Path, save_checkpoint, save_every: int) -> None:
        self.fitter, self.recipe, self.world = fitter, fitter.recipe, world
        self.shards, self.columns = shards, columns
        self.out_dir, self.save_checkpoint, self.save_every = out_dir, save_checkpoint, save_every
        self.state_path = out_dir / STATE_FILE
        self.generator = torch.Generator().manual_seed(self.recipe.seed + world.rank)
        self.log: list[dict] = []
        self.steps: int | None = None  # batches per epoch on every rank; None: all (one process)
        self.epoch_length = 0

    def start(self) -> Progress:
        """Where the run starts: where a saved state stops, else at the beginning; and the
        epochs' length, the same on every rank."""
        world, recipe = self.world, self.recipe
        if self.state_path.exists():
            progress = resume(self.state_path, self.fitter, self.generator, world)
        else:
            progress = Progress()
            if world.size > 1:  # each rank its own feature noise
                torch.manual_seed(recipe.seed + world.rank)
        self.log = progress.log
        own = self.shards[world.rank :: world.size]
        self.steps = world.min(count_batches(own, recipe.batch_size)) if world.size > 1 else None
        self.epoch_length = self.steps or count_batches(self.shards, recipe.batch_size)
        return progress

    def epoch(self, epoch: int, resumed: Progress | None) -> None:
        """Train epoch ``epoch`` (from where ``resumed`` stopped, if given), then write its
        checkpoint, the state and the log."""
        recipe, world = self.recipe, self.world
        # the epoch's wall time includes the part trained before an interruption
        started, shuffle = time.time() - (resumed.wall_s if resumed else 0.0), self.generator.get_state()
        skip, sums = (resumed.batches, resumed.sums) if resumed else (0, None)
        batches = epoch_batches(self.shards, recipe.batch_size, [self.generator], self.columns, [world.rank],
                                world.size, self.steps, skip)

        def save(done: int, so_far: dict) -> None:
            self.save_within(epoch, done, so_far, shuffle, started)

        entry = _run_epoch(self.fitter, batches, epoch, world, skip, sums, save,
                           first_step=epoch * self.epoch_length, total_steps=recipe.epochs * self.epoch_length)
        self.log.append({**entry, "wall_s": time.time() - started})
        self.save_epoch(epoch)

    def save_within(self, epoch: int, done: int, so_far: dict, shuffle: torch.Tensor, started: float) -> None:
        """The state ``done`` batches into ``epoch``, every ``save_every`` batches (the epoch's
        end saves anyway)."""
        if self.save_every and done % self.save_every == 0 and done < self.epoch_length:
            state = gathered_state(self.fitter, self.world, epoch - 1, self.log, shuffle, done, so_far)
            if self.world.main:
                write_state(self.state_path, {**state, "wall_s": time.time() - started})

    def save_epoch(self, epoch: int) -> None:
        """The checkpoint of ``epoch``, the state after it and the log (rank 0 writes)."""
        state = gathered_state(self.fitter, self.world, epoch, self.log, self.generator.get_state())
        if self.world.main:  # the checkpoint first: a state never says an epoch is done without it
            self.save_checkpoint(self.fitter.checkpoint_model(state["model"]), self.out_dir / f"epoch_{epoch}")
            write_state(self.state_path, state)
            # the log of the saved state
            (self.out_dir / LOG_FILE).write_text("".join(json.dumps(e) + "\n" for e in self.log))
        self.world.barrier()

    def finish(self) -> None:
        """The final checkpoint."""
        weights = self.fitter.full_model_state()
        if self.world.main:
            self.save_checkpoint(self.fitter.checkpoint_model(weights), self.out_dir / "final")
        self.world.barrier()


def _run_epoch(
    fitter: Fitter, batches: Iterator[dict[str, torch.Tensor]], epoch: int, world: World, skipped: int = 0,
    sums: dict | None = None, after_batch: Callable[[int, dict], None] = lambda done, sums: None,
    first_step: int = 0, total_steps: int = 1,
) -> dict:
    """Train on one epoch's ``batches`` (the first ``skipped`` already trained, with ``sums``),
    calling ``after_batch(batches done, sums)`` after each; the epoch's log entry (over every
    rank), less its time. The epoch's first batch is optimizer step ``first_step`` of
    ``total_steps`` (the learning-rate schedule's clock)."""
    recipe = fitter.recipe
    percent, steps = recipe.percent(epoch), recipe.steps(epoch)
    sums = sums or {"loss": 0.0, "batches": 0, "acc": [0.0] * steps, "masked": 0, "eligible": 0, "counted": 0}
    bar = tqdm(batches, desc=f"epoch {epoch + 1}/{recipe.epochs}", unit="batch", initial=skipped,
               disable=not world.main)
    for done, batch in enumerate(bar, start=skipped + 1):
        lr = recipe.learning_rate(first_step + done - 1, total_steps)
        result = fitter.step(batch, steps, percent, lr)
        sums["loss"] += result.loss.item()
        sums["batches"] += 1
        sums["acc"] = [a + b for a, b in zip(sums["acc"], result.step_acc)]
        for key in ("masked", "eligible", "counted"):
            sums[key] += getattr(result, key)
        bar.set_postfix(loss=f"{result.loss.item():.3f}", acc0=f"{result.step_acc[0]:.2f}",
                        masked=f"{result.masked / max(result.eligible, 1):.0%}")
        after_batch(done, sums)
    sums = _union_sums(sums, world)
    n = max(sums["batches"], 1)
    return {
        "epoch": epoch, "p_t": percent, "n_t": steps, "loss": sums["loss"] / n,
        "acc_per_step": [a / n for a in sums["acc"]],
        "masked_fraction": sums["masked"] / max(sums["eligible"], 1),
        "positions_trained": sums["counted"],
    }
