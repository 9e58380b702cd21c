"""One optimizer step over a drafter (``Fitter``), in one process or data-parallel (DDP, FSDP),
and the full states checkpoints and the training state are written from."""

from __future__ import annotations

import copy

import torch
from torch.nn.parallel import DistributedDataParallel

from .distributed import DDP, FSDP, SINGLE, World, shard_drafter
from .loss import BatchResult, ttt_loss
from .recipe import Recipe


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
        self.device_type = draft_head.device.type

    def step(self, batch: dict[str, torch.Tensor], steps: int, percent: float, lr: float) -> BatchResult:
        """One optimizer step on ``batch``; with the recipe's ``autocast`` the loss's forward runs
        in that dtype (its backward follows it), the weights and AdamW stay float32."""
        dtype = getattr(torch, self.recipe.autocast) if self.recipe.autocast else None
        with torch.autocast(self.device_type, dtype=dtype, enabled=dtype is not None):
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
