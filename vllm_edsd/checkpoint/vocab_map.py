"""The draft vocabulary's map onto the target's (``d2t``, and ``t2d`` where present), checked
before any engine starts: vLLM indexes the target vocabulary with ``j + d2t[j]``, and an id
out of range ends in an IndexError on a CPU or a device-side assert that kills a GPU engine."""

from __future__ import annotations

from pathlib import Path

import torch

from vllm_edsd.checkpoint.files import read_tensor, tensor_files
from vllm_edsd.errors import EDSDError

INTEGER_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8)


def check_vocab_mapping(
    d2t: torch.Tensor | None, t2d: torch.Tensor | None, vocab_size: int, draft_vocab_size: int, source: str,
) -> None:
    """Draft id ``j`` is target id ``j + d2t[j]`` (the identity without ``d2t``): each must be a
    target id, and ``t2d``, if present, must mark exactly those ids."""
    if d2t is not None and d2t.dtype not in INTEGER_DTYPES:
        raise EDSDError(f"{source}: 'd2t' must be an integer tensor, got {d2t.dtype}")
    if t2d is not None and t2d.dtype != torch.bool:
        raise EDSDError(f"{source}: 't2d' must be a bool tensor, got {t2d.dtype}")
    for name, tensor, length in (("d2t", d2t, draft_vocab_size), ("t2d", t2d, vocab_size)):
        if tensor is not None and tuple(tensor.shape) != (length,):
            raise EDSDError(f"{source}: tensor '{name}' has shape {list(tensor.shape)}, expected [{length}]")
    offsets = torch.zeros(draft_vocab_size, dtype=torch.long) if d2t is None else d2t.long()
    ids = torch.arange(draft_vocab_size) + offsets  # a wrapped int64 sum is negative: refused too
    bad = torch.nonzero((ids < 0) | (ids >= vocab_size)).flatten()
    if len(bad):
        j = int(bad[0])
        raise EDSDError(
            f"{source}: 'd2t' maps draft id {j} to target id {j} + d2t[{j}] = {j} + {int(offsets[j])}, outside the "
            f"target vocabulary 0..{vocab_size - 1}" + (f" ({len(bad)} such entries)" if len(bad) > 1 else "")
        )
    if t2d is None:
        return
    if int(t2d.sum()) != draft_vocab_size:
        raise EDSDError(f"{source}: 't2d' marks {int(t2d.sum())} target ids but draft_vocab_size is {draft_vocab_size}")
    marked = torch.nonzero(t2d).flatten()
    if not torch.equal(ids, marked):
        j = int(torch.nonzero(ids != marked).flatten()[0])
        raise EDSDError(f"{source}: 'd2t' and 't2d' disagree: draft id i + d2t[i] must list the ids where t2d is "
                        f"true, ascending; draft id {j} maps to {int(ids[j])}, t2d's {j}-th id is {int(marked[j])}")


def check_checkpoint_vocab_mapping(path: str | Path, vocab_size: int, draft_vocab_size: int) -> None:
    """``check_vocab_mapping`` on a drafter directory, reading those two tensors only."""
    files = tensor_files(path)
    d2t, t2d = (read_tensor(files[name], name) if name in files else None for name in ("d2t", "t2d"))
    check_vocab_mapping(d2t, t2d, vocab_size, draft_vocab_size, source=str(path))
