"""EDTrain's loop over training-time test (docs/architecture.md, "Data flow"), shared by EDSD and the EAGLE-3 baseline.

Alignment: the drafter at index p receives the target feature f_p and the token x_{p+1} and
predicts x_{p+2}, whose target distribution is the target's output at position p+1. Step k
(k = 0..n_t-1) at index p sits at RoPE position p+k, is fed x_{p+k+1} and the previous
step's pre-norm output, and predicts x_{p+k+2}. Writing j = p+k+1 for the target position,
a prediction counts when x_{j+1} is an assistant token, the target's argmax at j is in the
draft vocabulary, and (Mask-p_t) j is not among the epoch's highest-entropy positions
(ranked as the recipe's reading of EDTrain says, ``schedule.py``).
Soft labels are the target's probabilities restricted to the draft vocabulary; step k's
loss is weighted 0.8^k.
"""

from __future__ import annotations

import copy
import json
import math
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from itertools import islice
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from vllm_edsd.checkpoint.files import replace_file, torch_load_failure
from vllm_edsd.errors import EDSDError
from vllm_edsd.features.hidden_states import token_entropy
from vllm_edsd.features.shards import SHARD_SIZE, batch_count, iterate_batches, join_batches, shard_samples
from vllm_edsd.methods.blocks import KeyValueSteps
from vllm_edsd.methods.registry import EDSD

from .distributed import DDP, FSDP, SINGLE, World, shard_drafter
from .schedule import DRAFT_VOCAB, READINGS, entropy_mask

STEP_WEIGHT = 0.8
STATE_FILE = "training_state.pt"
LR_SCHEDULES = ("cosine", "constant")
# What a saved state that predates a recipe field trained with (the field's default may differ).
EARLIER_RECIPE = {"lr_schedule": "constant", "warmup": 0.0, "weight_decay": 0.01}
LOG_FILE = "train_log.jsonl"


@dataclass
class Recipe:
    """How one drafter is trained; EDSD's defaults are the paper's."""

    method: str = EDSD
    epochs: int = 8
    max_ttt_steps: int = 7
    reading: str = "paper"  # of EDTrain's schedules: "paper" or "specforge"
    gamma: float | None = None  # Mask-p_t percent per remaining epoch; None: the reading's
    mask_p: bool = True
    step_n: bool = True
    lr: float = 5e-5
    lr_schedule: str = "cosine"  # "cosine": linear warm-up, then cosine decay to 0 (SpecForge); or "constant"
    warmup: float = 0.015  # fraction of the optimizer steps warmed up (SpecForge's 1.5 %)
    weight_decay: float = 0.0  # AdamW's (SpecForge's 0; torch's default would be 0.01)
    batch_size: int = 4
    grad_clip: float = 0.5
    seed: int = 0
    feature_noise: float = 0.0  # Gaussian noise on the target features, relative to each layer's RMS

    def percent(self, epoch: int) -> float:
        return READINGS[self.reading].mask_percent(epoch, self.epochs, self.gamma) if self.mask_p else 0.0

    def learning_rate(self, step: int, total: int) -> float:
        """The learning rate of optimizer step ``step`` (0-based) of ``total``."""
        if self.lr_schedule == "constant":
            return self.lr
        warm = math.ceil(self.warmup * total)
        if step < warm:
            return self.lr * (step + 1) / warm
        return self.lr * 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, total - warm)))

    def steps(self, epoch: int) -> int:
        return (
            READINGS[self.reading].ttt_steps(epoch, self.epochs, self.max_ttt_steps)
            if self.step_n
            else self.max_ttt_steps
        )


@dataclass
class BatchResult:
    loss: torch.Tensor
    step_acc: list[float] = field(default_factory=list)
    counted: int = 0
    masked: int = 0
    eligible: int = 0


def _shift(x: torch.Tensor, k: int, fill) -> torch.Tensor:
    """x[:, k:] right-padded back to the original length."""
    if k == 0:
        return x
    pad = torch.full_like(x[:, :k], fill)
    return torch.cat([x[:, k:], pad], 1)


def add_feature_noise(features: torch.Tensor, layer_width: int, relative_std: float) -> torch.Tensor:
    """``features`` (layers concatenated, ``layer_width`` each) plus Gaussian noise whose standard
    deviation is ``relative_std`` times each layer's RMS at that position: the same relative
    perturbation for a quiet early layer and a loud late one."""
    layers = features.unflatten(-1, (-1, layer_width))
    rms = layers.pow(2).mean(-1, keepdim=True).sqrt()
    return (layers + relative_std * rms * torch.randn_like(layers)).flatten(-2)


def ttt_loss(
    model, batch: dict[str, torch.Tensor], draft_head: torch.Tensor, num_steps: int, percent: float,
    reading: str = "paper", feature_noise: float = 0.0, world: World = SINGLE,
) -> BatchResult:
    """Training-time-test loss of one batch (see the module docstring for the alignment).
    ``draft_head`` holds the target's ``lm_head`` rows of the draft vocabulary, in draft-id order;
    ``feature_noise`` > 0 perturbs the target features (a regulariser: served features are never
    exactly the training ones).

    Each step's sum is divided by the count of loss positions of the *union* of the ranks'
    batches over ``world.size`` (one ``world.sum`` per batch): DDP's gradient average then equals
    one process's gradient of the union batch, and so do the loss and accuracies averaged over
    the ranks. With one process this is the batch's own count."""
    device = draft_head.device
    schedule = READINGS[reading]
    ids, loss_mask = batch["input_ids"].to(device), batch["loss_mask"].to(device)
    features = batch["aux"].to(device).float()
    if feature_noise > 0:
        features = add_feature_noise(features, model.config.target_hidden_size, feature_noise)
    with torch.no_grad():
        draft_logits = batch["final"].to(device).float() @ draft_head.T  # the target's, over the draft vocabulary
        soft = torch.softmax(draft_logits, -1)
        target_argmax = batch["target_argmax"].to(device)
        in_draft_vocab = model.t2d[target_argmax.clamp(min=0)] & (target_argmax >= 0)
        predicts_assistant = _shift(loss_mask, 1, False)  # x_{j+1} is an assistant token
        if schedule.entropy_over == DRAFT_VOCAB:  # SpecForge: rank only positions that can count
            eligible, entropy = predicts_assistant & in_draft_vocab, token_entropy(draft_logits)
        else:
            eligible, entropy = predicts_assistant, batch["target_entropy"].to(device)
        kept = entropy_mask(entropy, eligible, percent, schedule.scope)
        counted = kept & in_draft_vocab
    b, t = ids.shape
    positions = torch.arange(t, device=device).expand(b, t)
    weights = [_shift(counted, k + 1, False).float() for k in range(num_steps)]
    denoms = world.sum(torch.stack([weight.sum() for weight in weights])).clamp(min=1) / world.size
    g, kv = model.project(features), KeyValueSteps()
    total, accs = 0.0, []
    for k, (weight, denom) in enumerate(zip(weights, denoms)):
        logits, g = model.step(g, _shift(ids, k + 1, 0), positions + k, kv)
        log_q = F.log_softmax(logits.float(), -1)
        total = total + STEP_WEIGHT**k * -(weight * (_shift(soft, k + 1, 0.0) * log_q).sum(-1)).sum() / denom
        with torch.no_grad():
            hit = model.draft_to_target(logits.argmax(-1)) == _shift(target_argmax, k + 1, -1)
            accs.append(float((hit.float() * weight).sum() / denom))
    return BatchResult(
        loss=total, step_acc=accs, counted=int(counted.sum()),
        masked=int((eligible & ~kept).sum()), eligible=int(eligible.sum()),
    )


def _read_state(path: Path) -> dict:
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


def _rank_state(shuffle: torch.Tensor, sums: dict | None = None) -> dict:
    """What makes this rank's rest of the run exact after a resume: its shuffling generator's
    state at the start of the epoch in progress (or the next), its RNG states now, and within
    an epoch its sums so far (``--save-every``)."""
    state = {"generator": shuffle, "rng": {"torch": torch.get_rng_state(), "python": random.getstate()}}
    return state if sums is None else {**state, "sums": sums}


class _Loss(torch.nn.Module):
    """``ttt_loss`` as a module's forward: DDP arranges its gradient averaging in forward."""

    def __init__(self, model, draft_head: torch.Tensor, recipe: Recipe, world: World) -> None:
        super().__init__()
        self.model, self.draft_head, self.recipe, self.world = model, draft_head, recipe, world

    def forward(self, batch: dict[str, torch.Tensor], steps: int, percent: float) -> BatchResult:
        return ttt_loss(self.model, batch, self.draft_head, steps, percent, self.recipe.reading,
                        self.recipe.feature_noise, self.world)


def _state_dicts():
    """torch's state-dict functions for any parallelism, imported when training saves or resumes:
    they import DTensor, about a second that ``edsd --help`` and ``edsd features`` need not pay."""
    from torch.distributed.checkpoint import state_dict

    return state_dict


def _full_on_cpu():
    """Checkpoints and the training state hold full tensors on the CPU, whatever the parallelism."""
    return _state_dicts().StateDictOptions(full_state_dict=True, cpu_offload=True)


class Fitter:
    """A drafter, its optimizer and one optimizer step. With ``world.size`` > 1 the loss runs in
    torch's DistributedDataParallel, which averages the gradients over the ranks, or (FSDP) the
    drafter is sharded over them (``distributed.shard_drafter``) and FSDP averages them."""

    def __init__(self, model, draft_head: torch.Tensor, recipe: Recipe, world: World = SINGLE) -> None:
        self.model, self.recipe = model, recipe
        self.full_model = model  # what rank 0 writes checkpoints from
        if world.data_parallel == FSDP:
            model.cpu()  # sharding moves each rank's shards back to its device
            self.full_model = copy.deepcopy(model) if world.main else None  # unsharded, in host memory
            shard_drafter(model, world)
        self.trainable = [p for p in model.parameters() if p.requires_grad]  # FSDP's: this rank's shards
        self.optimizer = torch.optim.AdamW(self.trainable, lr=recipe.lr, betas=(0.9, 0.95),
                                           weight_decay=recipe.weight_decay)
        loss = _Loss(model, draft_head, recipe, world)
        self.loss = DistributedDataParallel(loss) if world.data_parallel == DDP else loss

    def step(self, batch: dict[str, torch.Tensor], steps: int, percent: float, lr: float) -> BatchResult:
        result = self.loss(batch, steps, percent)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad()
        result.loss.backward()
        # FSDP's sharded gradients are DTensors: their norm is the whole drafter's
        torch.nn.utils.clip_grad_norm_(self.trainable, self.recipe.grad_clip)
        self.optimizer.step()
        return result

    def full_model_state(self) -> dict[str, torch.Tensor]:
        """The drafter's full tensors on the CPU: on rank 0, empty on the others. Every rank
        calls it (FSDP gathers the shards)."""
        return _state_dicts().get_model_state_dict(self.model, options=_full_on_cpu())

    def full_optimizer_state(self) -> dict:
        """AdamW's full state on the CPU, keyed by parameter name: on rank 0, as above."""
        return _state_dicts().get_optimizer_state_dict(self.model, self.optimizer, options=_full_on_cpu())

    def load_full_state(self, state: dict) -> None:
        """Load the saved ``model`` and ``optimizer`` (also an optimizer state keyed by index, as
        this trainer saved it before FSDP): under FSDP each rank keeps its shards."""
        states = _state_dicts()
        states.set_model_state_dict(self.model, state["model"], options=_full_on_cpu())
        states.set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"], options=_full_on_cpu())

    def checkpoint_model(self, weights: dict[str, torch.Tensor]):
        """On rank 0, a drafter holding ``weights`` (``full_model_state``) for ``save_checkpoint``:
        the trained one itself, or under FSDP rank 0's unsharded copy, loaded with them."""
        if self.full_model is not self.model:
            self.full_model.load_state_dict(weights)
        return self.full_model


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


def _check_parallelism(state: dict, run: Path, world: World) -> None:
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
class _Progress:
    """Where a run resumes: the epoch to run, its batches already trained, this rank's sums of
    them (none at an epoch's start) and the wall time they took, and the log of the finished epochs."""

    epoch: int = 0
    batches: int = 0
    sums: dict | None = None
    wall_s: float = 0.0
    log: list[dict] = field(default_factory=list)


def _resume(state_path: Path, fitter: Fitter, generator: torch.Generator, world: World) -> _Progress:
    """Where the saved run stops, with the model, optimizer and this rank's shuffling and RNG
    states as saved: after the last finished epoch, or ``--save-every`` batches into the next."""
    state, recipe = _read_state(state_path), fitter.recipe
    _check_parallelism(state, state_path.parent, world)
    defaults = {name: f.default for name, f in Recipe.__dataclass_fields__.items()}
    if {**defaults, **EARLIER_RECIPE, **state["recipe"]} != asdict(recipe):  # a field added since: as trained
        raise EDSDError(f"{state_path.parent}: holds an interrupted run with a different recipe; use another --out")
    fitter.load_full_state(state)
    own = state["ranks"][world.rank] if world.size > 1 else state
    generator.set_state(own["generator"])
    torch.set_rng_state(own["rng"]["torch"])
    random.setstate(own["rng"]["python"])
    progress = _Progress(state["epoch"] + 1, state.get("batches", 0), own.get("sums"), state.get("wall_s", 0.0),
                         state["log"])
    if world.main:
        where = f"{progress.batches} batches into epoch {progress.epoch + 1}" if progress.batches else \
            f"after epoch {state['epoch']}"
        print(f"resuming {state_path.parent} {where}")
    return progress


def _gathered_state(fitter: Fitter, world: World, finished: int, log: list[dict], shuffle: torch.Tensor,
                    batches: int = 0, sums: dict | None = None) -> dict:
    """Every rank: gather the full weights, AdamW state and each rank's RNG states into the
    training state, which rank 0 gets (the others an empty dict). ``finished`` is the last
    finished epoch, ``batches`` how far into the next one."""
    ranks = world.gather(_rank_state(shuffle, sums if batches else None))
    weights, optimizer = fitter.full_model_state(), fitter.full_optimizer_state()
    if not world.main:
        return {}
    state = {"recipe": asdict(fitter.recipe), "model": weights, "optimizer": optimizer, **ranks[0],
             "epoch": finished, "batches": batches, "log": log, "world_size": world.size,
             "data_parallel": world.data_parallel}
    return {**state, "ranks": ranks} if world.size > 1 else state


def _write_state(path: Path, state: dict) -> None:
    """An interruption mid-write keeps the old state."""
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_file(path, lambda tmp: torch.save(state, tmp))


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
    fitter = Fitter(model, draft_head, recipe, world)
    generator = torch.Generator().manual_seed(recipe.seed + world.rank)
    state_path, log_path = out_dir / STATE_FILE, out_dir / LOG_FILE
    if state_path.exists():
        progress = _resume(state_path, fitter, generator, world)
    else:
        progress = _Progress()
        if world.size > 1:  # each rank its own feature noise
            torch.manual_seed(recipe.seed + world.rank)
    log = progress.log
    steps = world.min(count_batches(shards[world.rank :: world.size], recipe.batch_size)) if world.size > 1 else None
    epoch_length = steps or count_batches(shards, recipe.batch_size)
    for epoch in range(progress.epoch, recipe.epochs):
        resumed = epoch == progress.epoch
        # the epoch's wall time includes the part trained before an interruption
        started, shuffle = time.time() - (progress.wall_s if resumed else 0.0), generator.get_state()
        skip, sums = (progress.batches, progress.sums) if resumed else (0, None)
        batches = epoch_batches(shards, recipe.batch_size, [generator], columns, [world.rank], world.size, steps, skip)

        def save(done: int, so_far: dict, epoch=epoch, shuffle=shuffle, started=started) -> None:
            if save_every and done % save_every == 0 and done < epoch_length:  # the epoch's end saves anyway
                state = _gathered_state(fitter, world, epoch - 1, log, shuffle, done, so_far)
                if world.main:
                    _write_state(state_path, {**state, "wall_s": time.time() - started})

        entry = _run_epoch(fitter, batches, epoch, world, skip, sums, save, first_step=epoch * epoch_length,
                           total_steps=recipe.epochs * epoch_length)
        log.append({**entry, "wall_s": time.time() - started})
        state = _gathered_state(fitter, world, epoch, log, generator.get_state())
        if world.main:  # the checkpoint first: a state never says an epoch is done without it
            save_checkpoint(fitter.checkpoint_model(state["model"]), out_dir / f"epoch_{epoch}")
            _write_state(state_path, state)
            log_path.write_text("".join(json.dumps(e) + "\n" for e in log))  # the log of the saved state
        world.barrier()
    weights = fitter.full_model_state()
    if world.main:
        save_checkpoint(fitter.checkpoint_model(weights), out_dir / "final")
    world.barrier()
    return log


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
