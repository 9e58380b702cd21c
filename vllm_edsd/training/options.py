"""``edsd train``'s options as a typed value (``TrainOptions``): the command's flags with its
defaults, which the command parses into and the pipeline builds directly."""

from __future__ import annotations

from dataclasses import dataclass

from vllm_edsd.features.samples import SampleOptions
from vllm_edsd.methods.edsd.config import RMSNORM
from vllm_edsd.methods.registry import EDSD

from .distributed import DDP


@dataclass(frozen=True, kw_only=True)
class TrainOptions(SampleOptions):
    """One drafter's training: the samples (``SampleOptions``), the drafter, EDTrain's recipe and
    where the run writes."""

    out: str  # run directory: checkpoints, the training state, train_log.jsonl
    method: str = EDSD  # a registered method (vllm_edsd.methods.METHODS)
    layers: tuple[int, ...] | None = None  # the aux layer ids, vLLM's convention
    layers_from: str | None = None  # the JSON `edsd select` wrote (EDSelect's layers)
    epochs: int = 8  # T
    ttt_steps: int = 7  # S_max of the curriculum, or the fixed steps without it
    edtrain_reading: str = "paper"  # schedule.READINGS
    gamma: float | None = None  # Mask-p_t percent per remaining epoch; None: the reading's
    token_norm: str = RMSNORM  # EDFuse's norm of the token embedding
    attention_reads_token: bool = False  # EDSD's q/k/v also read the token (edsd_config's switch)
    feature_norm: bool = False  # EDFuse's gate reads the normed feature (edsd_config's switch)
    fuse_residual: bool = False  # EDFuse adds its feature input to its output (edsd_config's switch)
    norm_before_fc: bool = False  # EAGLE 3.1's, either method: one RMSNorm over fc's whole input
    fc_norm: bool = False  # EAGLE 3.1's, either method: one RMSNorm per target layer before fc
    norm_before_residual: bool = False  # EAGLE 3.1's, either method: the residual is the normed input
    norm_output: bool = False  # EAGLE 3.1: the fed-back state is the final norm's output
    no_mask_p: bool = False  # ablation: no entropy mask
    no_step_n: bool = False  # ablation: fixed TTT steps
    feature_noise: float = 0.0  # Gaussian noise on the features, relative to each layer's RMS
    lr: float = 5e-5
    lr_schedule: str = "cosine"  # recipe.LR_SCHEDULES
    warmup: float = 0.015  # fraction of the optimizer steps warmed up (cosine)
    weight_decay: float = 0.0
    autocast: str | None = None  # recipe.AUTOCAST_DTYPES: the loss's forward under torch.autocast
    batch_size: int = 4
    save_every: int = 0  # also save the state every N batches; 0: after each epoch only
    data_parallel: str = DDP  # under torchrun: distributed.DATA_PARALLEL
    cache: str | None = None  # regenerated answers and features; None: OUT/cache
    feature_layers: tuple[int, ...] | None = None  # extract these layers (a superset of the drafter's)
    draft_vocab_size: int | None = None  # None: min(32000, the target's vocabulary)
    fuse_intermediate_size: int | None = None  # EDFuse's width m; None: the target's FFN
    intermediate_size: int | None = None  # the draft layer's FFN; None: the target's
