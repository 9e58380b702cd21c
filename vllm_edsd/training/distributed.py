"""Data-parallel training under ``torchrun``: torch's DistributedDataParallel, or FSDP2
(``fully_shard``) where the drafter with its gradients and AdamW state does not fit one device
(docs/scale.md, "Training under torchrun").

``torchrun --nproc-per-node N -m vllm_edsd train ARGS`` starts N processes that each train on
their share of the feature shards; ``WORLD_SIZE`` > 1 in the environment (torchrun sets it with
``RANK``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``) joins them in one process group:
gloo on a CPU, NCCL on CUDA (each process on ``cuda:LOCAL_RANK``). Without it (or with 1) there
is no process group and training is exactly the one-process run.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from vllm_edsd.errors import EDSDError, first_line

# Collectives wait this long: rank 0 extracts the target's features while the others wait.
COLLECTIVE_TIMEOUT = timedelta(hours=24)
CONNECT_SECONDS = 60  # how long a rank waits for the master's address to accept connections
# How the ranks share the drafter (``edsd train --data-parallel``): every rank a full copy whose
# gradients are averaged, or weights, gradients and optimizer state sharded over the ranks.
DDP, FSDP = "ddp", "fsdp"
DATA_PARALLEL = (DDP, FSDP)


@dataclass(frozen=True)
class World:
    """This process's place among the training processes, and the collectives training needs;
    with ``size`` 1 every collective is the identity."""

    rank: int = 0
    size: int = 1
    device: str = "cpu"  # where collectives' tensors live
    data_parallel: str | None = None  # DDP or FSDP; None: one process

    @property
    def main(self) -> bool:
        """Rank 0: the one that extracts features, prints and writes."""
        return self.rank == 0

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` summed over the ranks (a new tensor)."""
        if self.size == 1:
            return tensor
        total = tensor.detach().to(self.device, copy=True)
        dist.all_reduce(total, dist.ReduceOp.SUM)
        return total.to(tensor.device)

    def min(self, value: int) -> int:
        """The smallest ``value`` of any rank."""
        if self.size == 1:
            return value
        least = torch.tensor([value], device=self.device)
        dist.all_reduce(least, dist.ReduceOp.MIN)
        return int(least.item())

    def gather(self, obj) -> list:
        """Every rank's ``obj``, in rank order, on every rank."""
        if self.size == 1:
            return [obj]
        objects = [None] * self.size
        dist.all_gather_object(objects, obj)
        return objects

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier()


SINGLE = World()


def _wait_for_master(address: str, port: int) -> None:
    """Fail in one line when the master cannot be reached, instead of waiting for the 24 h timeout."""
    deadline = time.monotonic() + CONNECT_SECONDS
    while True:
        try:
            socket.create_connection((address, port), timeout=5).close()
            return
        except socket.gaierror as exc:
            raise EDSDError(f"MASTER_ADDR {address!r}: unknown host ({exc.strerror})") from None
        except OSError as exc:
            if time.monotonic() > deadline:
                raise EDSDError(f"cannot reach the master at {address}:{port} ({exc.strerror or exc}) "
                                f"after {CONNECT_SECONDS} s: start every rank, or run under torchrun") from None
            time.sleep(0.5)


def _environment() -> tuple[int, int, int]:
    """RANK, WORLD_SIZE and LOCAL_RANK, checked."""
    try:
        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", rank))
    except (KeyError, ValueError) as exc:
        raise EDSDError(f"WORLD_SIZE is set but RANK/LOCAL_RANK are missing or not integers ({exc}); "
                        "start data-parallel training with torchrun") from None
    if not 0 <= rank < size:
        raise EDSDError(f"RANK {rank} is not in 0..{size - 1} (WORLD_SIZE {size})")
    return rank, size, local


def _rank_device(device: str, local_rank: int) -> str:
    """``device`` for this process: ``cuda`` (any index) becomes ``cuda:LOCAL_RANK``."""
    if not device.startswith("cuda"):
        return device
    if local_rank >= torch.cuda.device_count():
        raise EDSDError(f"LOCAL_RANK {local_rank} has no GPU: {torch.cuda.device_count()} visible; "
                        "start at most one process per GPU")
    torch.cuda.set_device(local_rank)
    return f"cuda:{local_rank}"


@contextmanager
def connect(device: str, data_parallel: str = DDP) -> Iterator[tuple[World, str]]:
    """This process's ``World`` and the device it trains on, for the duration of the block:
    a process group when ``WORLD_SIZE`` > 1 (destroyed on exit), whose ranks share the drafter
    as ``data_parallel`` says; none otherwise."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise EDSDError(f"--device {device}: CUDA is not available here; use --device cpu")
    if int(os.environ.get("WORLD_SIZE", "1") or "1") <= 1:
        yield SINGLE, device
        return
    rank, size, local = _environment()
    device = _rank_device(device, local)
    address, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not address or not (port or "").isdigit():
        raise EDSDError("WORLD_SIZE is set but MASTER_ADDR/MASTER_PORT are not: start data-parallel training "
                        "with torchrun")
    if rank > 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # rank 0 alone serves the store
        _wait_for_master(address, int(port))
    backend = "nccl" if device.startswith("cuda") else "gloo"
    try:
        dist.init_process_group(backend, rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT)
    except (RuntimeError, ValueError) as exc:
        raise EDSDError(f"cannot join the {size} training processes ({backend}): {first_line(exc)}") from exc
    try:
        yield World(rank, size, device if backend == "nccl" else "cpu", data_parallel), device
    finally:
        dist.destroy_process_group()


def shard_drafter(drafter: nn.Module, world: World) -> None:
    """FSDP2 over ``world``'s ranks, in place: the decoder layer is one group, the rest (``fc``,
    the fusion, norm and head, the frozen embedding) the root's. The loss calls the drafter's
    ``project`` and ``step``, never ``forward``, so those two gather the root's shards.
    Imported here: FSDP imports DTensor, about a second that other runs need not pay."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    mesh = init_device_mesh(torch.device(world.device).type, (world.size,))
    fully_shard(drafter.midlayer, mesh=mesh)
    fully_shard(drafter, mesh=mesh)
    for method in ("project", "step"):
        register_fsdp_forward_method(drafter, method)
