"""How one drafter is trained (``Recipe``): the method, the budget, EDTrain's schedules and
the optimizer's settings, saved with the training state so that a resume trains the same."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm_edsd.methods import method
from vllm_edsd.methods.registry import EDSD

from .curriculum import READINGS

if TYPE_CHECKING:
    from .options import TrainOptions

LR_SCHEDULES = ("cosine", "constant")
# The dtype a forward may run in under torch.autocast (bfloat16 needs no loss scaling, float16 would).
AUTOCAST_DTYPES = ("bfloat16",)


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
    autocast: str | None = None  # AUTOCAST_DTYPES: the loss's forward in it; weights, gradients, AdamW in float32

    @classmethod
    def from_options(cls, options: TrainOptions) -> Recipe:
        """The recipe ``edsd train`` runs with these options (EDTrain's curriculum where the method has one)."""
        curriculum = method(options.method).curriculum
        return cls(method=options.method, epochs=options.epochs, max_ttt_steps=options.ttt_steps,
                   reading=options.edtrain_reading, gamma=options.gamma,
                   mask_p=curriculum and not options.no_mask_p, step_n=curriculum and not options.no_step_n,
                   lr=options.lr, lr_schedule=options.lr_schedule, warmup=options.warmup,
                   weight_decay=options.weight_decay, batch_size=options.batch_size, seed=options.seed,
                   feature_noise=options.feature_noise, autocast=options.autocast)

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
