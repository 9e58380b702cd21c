"""The training-time-test loss of one batch (``ttt_loss``), shared by EDSD and the EAGLE-3
baseline (docs/architecture.md, "Data flow").

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

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from vllm_edsd.features.hidden_states import token_entropy
from vllm_edsd.methods.blocks import KeyValueSteps

from .curriculum import DRAFT_VOCAB, READINGS, entropy_mask
from .distributed import SINGLE, World

STEP_WEIGHT = 0.8


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
