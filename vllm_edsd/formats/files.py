"""Reading and writing drafter weights: safetensors (single or sharded) and legacy
``pytorch_model.bin`` (loaded with ``weights_only=True``: no arbitrary unpickling).

Readers yield tensors one at a time so that multi-GB drafters are streamed.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from vllm_edsd.errors import EDSDError

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
PYTORCH_BIN = "pytorch_model.bin"


def weight_files(path: str | Path) -> list[Path]:
    """The weight files of a checkpoint directory, in a fixed order."""
    path = Path(path)
    index = path / SAFETENSORS_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as exc:
            raise EDSDError(f"{index}: not a valid safetensors index ({exc!r})") from None
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (path / f).is_file()]
        if missing:
            raise EDSDError(f"{index}: shard(s) listed but missing: {', '.join(missing)}")
        return [path / f for f in files]
    if (path / SAFETENSORS).is_file():
        return [path / SAFETENSORS]
    if (path / PYTORCH_BIN).is_file():
        return [path / PYTORCH_BIN]
    raise EDSDError(f"{path}: no weights found ({SAFETENSORS}, {SAFETENSORS_INDEX} or {PYTORCH_BIN})")


def _open_safetensors(file: Path):
    from safetensors import safe_open

    try:
        return safe_open(str(file), framework="pt")
    except Exception as exc:  # safetensors raises its own error types for corrupt headers
        raise EDSDError(f"{file}: not a readable safetensors file, truncated or corrupt ({exc})") from None


def tensor_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Names and shapes without reading tensor data (header only for safetensors)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in weight_files(path):
        if file.suffix == ".bin":
            for name, tensor in _load_bin(file).items():
                shapes[name] = tuple(tensor.shape)
            continue
        with _open_safetensors(file) as f:
            for name in f.keys():
                if name in shapes:
                    raise EDSDError(f"{file}: tensor '{name}' appears in more than one shard")
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def _load_bin(file: Path) -> dict[str, torch.Tensor]:
    try:
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:
        raise EDSDError(f"{file}: cannot be loaded safely as a tensor dictionary ({exc.__class__.__name__}: {exc})") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise EDSDError(f"{file}: expected a flat dictionary of tensors")
    return state


def iter_tensors(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of a checkpoint directory."""
    for file in weight_files(path):
        if file.suffix == ".bin":
            yield from _load_bin(file).items()
            continue
        with _open_safetensors(file) as f:
            for name in f.keys():
                try:
                    yield name, f.get_tensor(name)
                except Exception as exc:
                    raise EDSDError(f"{file}: tensor '{name}' cannot be read, the file is truncated or corrupt ({exc})") from None


@contextmanager
def atomic_directory(dst: str | Path, *, force: bool = False) -> Iterator[Path]:
    """Build a directory next to ``dst`` and move it into place only on success.

    A failure leaves nothing at ``dst`` (and an existing ``dst`` untouched unless the new
    one is complete and ``force`` was given).
    """
    dst = Path(dst)
    if dst.exists() and not force:
        raise EDSDError(f"{dst}: already exists (use --force to replace it)")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.partial-", dir=dst.parent))
    try:
        yield tmp
        if dst.exists():
            old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
            os.replace(dst, old)
            os.replace(tmp, dst)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def save_safetensors(tensors: dict[str, torch.Tensor], file: str | Path, metadata: dict[str, str] | None = None) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(file), metadata=metadata or {"format": "pt"})


def cast_floating(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Floating-point tensors cast to ``dtype``; integer and bool ones (``d2t``, ``t2d``) kept as they are."""
    return {k: v.detach().to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}


def cast_checkpoint(src: str | Path, dst: str | Path, dtype: torch.dtype) -> None:
    """Copy a ``config.json`` + safetensors checkpoint with its floating tensors cast to ``dtype``."""
    src = Path(src)
    config = json.loads((src / "config.json").read_text())
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    tensors = cast_floating(dict(iter_tensors(src)), dtype)
    with atomic_directory(dst, force=True) as tmp:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_safetensors(tensors, tmp / SAFETENSORS)
