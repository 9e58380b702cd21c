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

import json
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from vllm_edsd.checkpoint.files import replace_file
from vllm_edsd.errors import EDSDError
from vllm_edsd.model.edsd import KeyValueSteps
from vllm_edsd.target.hidden_states import token_entropy

from .features import iterate_batches
from .schedule import DRAFT_VOCAB, READINGS, entropy_mask

STEP_WEIGHT = 0.8
STATE_FILE = "training_state.pt"
LOG_FILE = "train_log.jsonl"


@dataclass
class Recipe:
    """How one drafter is trained; EDSD's defaults are the paper's."""

    method: str = "edsd"
    epochs: int = 8
    max_ttt_steps: int = 7
    reading: str = "paper"  # of EDTrain's schedules: "paper" or "specforge"
    gamma: float | None = None  # Mask-p_t percent per remaining epoch; None: the reading's
    mask_p: bool = True
    step_n: bool = True
    lr: float = 5e-5
    batch_size: int = 4
    grad_clip: float = 0.5
    seed: int = 0
    feature_noise: float = 0.0  # Gaussian noise on the target features, relative to each layer's RMS

    def percent(self, epoch: int) -> float:
        return READINGS[self.reading].mask_percent(epoch, self.epochs, self.gamma) if self.mask_p else 0.0

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
    reading: str = "paper", feature_noise: float = 0.0,
) -> BatchResult:
    """Training-time-test loss of one batch (see the module docstring for the alignment).
    ``draft_head`` holds the target's ``lm_head`` rows of the draft vocabulary, in draft-id order;
    ``feature_noise`` > 0 perturbs the target features (a regulariser: served features are never
    exactly the training ones)."""
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
    g, kv = model.project(features), KeyValueSteps()
    total, accs = 0.0, []
    for k in range(num_steps):
        logits, g = model.step(g, _shift(ids, k + 1, 0), positions + k, kv)
        weight = _shift(counted, k + 1, False).float()
        denom = weight.sum().clamp(min=1)
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
        reason = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise EDSDError(f"{path}: not a training state this trainer wrote ({reason}); "
                        "remove it to start afresh or use another --out") from None
    if not isinstance(state, dict) or not {"recipe", "model", "optimizer", "epoch"} <= state.keys():
        raise EDSDError(
            f"{path}: not a training state this trainer wrote; remove it to start afresh or use another --out"
        )
    return state


def _rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def train(
    model,
    shards: list[Path],
    draft_head: torch.Tensor,
    recipe: Recipe,
    out_dir: Path,
    save_checkpoint,
    columns: torch.Tensor | None = None,
) -> list[dict]:
    """Train for ``recipe.epochs`` epochs, writing a checkpoint and a log line after each.

    Resumes from ``out_dir/training_state.pt`` when an earlier run was interrupted.
    ``save_checkpoint(model, directory)`` writes one checkpoint in the method's layout;
    ``columns`` picks the drafter's layers from shards stored for more (``features.aux_columns``).
    """
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=recipe.lr, betas=(0.9, 0.95))
    generator = torch.Generator().manual_seed(recipe.seed)
    start_epoch, log = 0, []
    state_path, log_path = out_dir / STATE_FILE, out_dir / LOG_FILE
    if state_path.exists():
        state = _read_state(state_path)
        defaults = {name: f.default for name, f in Recipe.__dataclass_fields__.items()}
        if {**defaults, **state["recipe"]} != asdict(recipe):  # a field added since: its default
            raise EDSDError(f"{out_dir}: holds an interrupted run with a different recipe; use another --out")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        generator.set_state(state["generator"])
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        start_epoch, log = state["epoch"] + 1, state["log"]
        print(f"resuming {out_dir} after epoch {state['epoch']}")
    for epoch in range(start_epoch, recipe.epochs):
        percent, steps = recipe.percent(epoch), recipe.steps(epoch)
        started = time.time()
        sums = {"loss": 0.0, "batches": 0, "acc": [0.0] * steps, "masked": 0, "eligible": 0, "counted": 0}
        bar = tqdm(iterate_batches(shards, recipe.batch_size, generator, columns),
                   desc=f"epoch {epoch + 1}/{recipe.epochs}", unit="batch")
        for batch in bar:
            result = ttt_loss(model, batch, draft_head, steps, percent, recipe.reading, recipe.feature_noise)
            optimizer.zero_grad()
            result.loss.backward()
            torch.nn.utils.clip_grad_norm_(trainable, recipe.grad_clip)
            optimizer.step()
            sums["loss"] += result.loss.item()
            sums["batches"] += 1
            sums["acc"] = [a + b for a, b in zip(sums["acc"], result.step_acc)]
            for key in ("masked", "eligible", "counted"):
                sums[key] += getattr(result, key)
            bar.set_postfix(loss=f"{result.loss.item():.3f}", acc0=f"{result.step_acc[0]:.2f}",
                            masked=f"{result.masked / max(result.eligible, 1):.0%}")
        n = max(sums["batches"], 1)
        entry = {
            "epoch": epoch, "p_t": percent, "n_t": steps, "loss": sums["loss"] / n,
            "acc_per_step": [a / n for a in sums["acc"]],
            "masked_fraction": sums["masked"] / max(sums["eligible"], 1),
            "positions_trained": sums["counted"], "wall_s": time.time() - started,
        }
        log.append(entry)
        save_checkpoint(model, out_dir / f"epoch_{epoch}")
        state = {"recipe": asdict(recipe), "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                 "generator": generator.get_state(), "rng": _rng_state(), "epoch": epoch, "log": log}
        # an interruption mid-write keeps the old state
        replace_file(state_path, lambda tmp: torch.save(state, tmp))  # noqa: B023 (called at once)
        log_path.write_text("".join(json.dumps(e) + "\n" for e in log))  # the log of the saved state
    save_checkpoint(model, out_dir / "final")
    return log
