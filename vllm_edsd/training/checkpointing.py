"""The training state (``training_state.pt``): what is saved after each epoch (and every
``--save-every`` batches), so that an interrupted run resumes exactly where it was saved, and
how it is read back and checked against the run that resumes it."""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from vllm_edsd.checkpoint.files import replace_file, torch_load_failure
from vllm_edsd.errors import EDSDError

from .distributed import DDP, World
from .fitter import Fitter
from .recipe import Recipe

STATE_FILE = "training_state.pt"
# What a saved state that predates a recipe field trained with (the field's default may differ).
EARLIER_RECIPE = {"lr_schedule": "constant", "warmup": 0.0, "weight_decay": 0.01}


def read_state(path: Path) -> dict:
    """The saved training state, loaded without unpickling anything but tensors and plain data."""
    try:
        state = torch.load(path, weights_only=True)
    except Exception as exc:  # torch raises UnpicklingError, RuntimeError or EOFError, by version
        raise EDSDError(f"{path}: not a training state this trainer wrote ({torch_load_failure(exc)}); "
                        "remove it to start afresh or use another --out") from exc
    if not isinstance(state, dict) or not {"recipe", "model", "optimizer", "epoch"} <= state.keys():
        raise EDSDError(
            f"{path}: not a training state this trainer wrote; remove it to start afresh or use another --out"
        )
    return state


def saved_recipe(state: dict) -> dict:
    """The recipe a saved state trained with, every field named: a field added since the state
    was written reads as what the run trained with (``EARLIER_RECIPE``, else its default)."""
    defaults = {name: f.default for name, f in Recipe.__dataclass_fields__.items()}
    return {**defaults, **EARLIER_RECIPE, **state["recipe"]}


def rank_state(shuffle: torch.Tensor, sums: dict | None = None) -> dict:
    """What makes this rank's rest of the run exact after a resume: its shuffling generator's
    state at the start of the epoch in progress (or the next), its RNG states now, and within
    an epoch its sums so far (``--save-every``)."""
    state = {"generator": shuffle, "rng": {"torch": torch.get_rng_state(), "python": random.getstate()}}
    return state if sums is None else {**state, "sums": sums}


def check_parallelism(state: dict, run: Path, world: World) -> None:
    """Refuse to resume a run with another number of processes or another ``--data-parallel``:
    the ranks' data orders and RNG states are saved per rank (states written before FSDP
    existed say nothing of it: DDP with several processes)."""
    size = state.get("world_size", 1)
    data_parallel = state.get("data_parallel", DDP if size > 1 else None)
    if (size, data_parallel) != (world.size, world.data_parallel):
        how = (f"torchrun --nproc-per-node {size} -m vllm_edsd train --data-parallel {data_parallel} ..."
               if data_parallel else "edsd train, without torchrun")
        raise EDSDError(f"{run}: holds a run of {size} training process(es) ({how}); resume it with as many and "
                        "the same --data-parallel, or use another --out")


@dataclass
class Progress:
    """Where a run resumes: the epoch to run, its batches already trained, this rank's sums of
    them (none at an epoch's start) and the wall time they took, and the log of the finished epochs."""

    epoch: int = 0
    batches: int = 0
    sums: dict | None = None
    wall_s: float = 0.0
    log: list[dict] = field(default_factory=list)


def resume(state_path: Path, fitter: Fitter, generator: torch.Generator, world: World) -> Progress:
    """Where the saved run stops, with the model, optimizer and this rank's shuffling and RNG
    states as saved: after the last finished epoch, or ``--save-every`` batches into the next."""
    state = read_state(state_path)
    check_parallelism(state, state_path.parent, world)
    if saved_recipe(state) != asdict(fitter.recipe):
        raise EDSDError(f"{state_path.parent}: holds an interrupted run with a different recipe; use another --out")
    fitter.load_full_state(state)
    own = state["ranks"][world.rank] if world.size > 1 else state
    generator.set_state(own["generator"])
    torch.set_rng_state(own["rng"]["torch"])
    random.setstate(own["rng"]["python"])
    progress = Progress(state["epoch"] + 1, state.get("batches", 0), own.get("sums"), state.get("wall_s", 0.0),
                         state["log"])
    if world.main:
        where = f"{progress.batches} batches into epoch {progress.epoch + 1}" if progress.batches else \
            f"after epoch {state['epoch']}"
        print(f"resuming {state_path.parent} {where}")
    return progress


def gathered_state(fitter: Fitter, world: World, finished: int, log: list[dict], shuffle: torch.Tensor,
                    batches: int = 0, sums: dict | None = None) -> dict:
    """Every rank: gather the full weights, AdamW state and each rank's RNG states into the
    training state, which rank 0 gets (the others an empty dict). ``finished`` is the last
    finished epoch, ``batches`` how far into the next one."""
    ranks = world.gather(rank_state(shuffle, sums if batches else None))
    weights, optimizer = fitter.full_model_state(), fitter.full_optimizer_state()
    if not world.main:
        return {}
    state = {"recipe": asdict(fitter.recipe), "model": weights, "optimizer": optimizer, **ranks[0],
             "epoch": finished, "batches": batches, "log": log, "world_size": world.size,
             "data_parallel": world.data_parallel}
    return {**state, "ranks": ranks} if world.size > 1 else state


def write_state(path: Path, state: dict) -> None:
    """An interruption mid-write keeps the old state."""
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_file(path, lambda tmp: torch.save(state, tmp))
