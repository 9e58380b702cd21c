"""Reading and writing drafter weights: safetensors (single or sharded) and legacy
``pytorch_model.bin`` (loaded with ``weights_only=True``: no arbitrary unpickling).

Readers yield tensors one at a time so that multi-GB drafters are streamed. A checkpoint's
fingerprint (config.json and its weight files, sampled) names what cached target features
were computed from.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath

import torch

from vllm_edsd.errors import EDSDError, first_line

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
PYTORCH_BIN = "pytorch_model.bin"
# The dtypes of a drafter's weights, and of a target's while its features are read.
SUPPORTED_DTYPES = ("float32", "float16", "bfloat16")


def load_json(file: Path) -> object:
    """A JSON file's content; anything unreadable (bad syntax, bytes, nesting too deep for the
    parser, integers of thousands of digits) is one error naming the file."""
    try:
        return json.loads(file.read_text())
    except RecursionError:
        raise EDSDError(f"{file}: invalid JSON (nested too deeply)") from None
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError, and int() of a huge number
        raise EDSDError(f"{file}: invalid JSON ({exc})") from None


FINGERPRINT_SAMPLE = 1 << 20  # bytes read at each end of a weight file


def checkpoint_fingerprint(path: str | Path) -> str:
    """A short hash of a checkpoint directory's ``config.json`` and of its weight files' names,
    sizes, first and last MiB: cheap for a target of many GB, the same after a copy (no mtime),
    and changed by new weights (a safetensors file starts with its header and first tensor)."""
    path = Path(path)
    digest = hashlib.sha256((path / "config.json").read_bytes())
    for file in weight_files(path):
        size = file.stat().st_size
        digest.update(json.dumps([file.name, size]).encode())
        with open(file, "rb") as f:
            digest.update(f.read(FINGERPRINT_SAMPLE))
            f.seek(max(size - FINGERPRINT_SAMPLE, 0))
            digest.update(f.read(FINGERPRINT_SAMPLE))
    return digest.hexdigest()[:16]


def _shard_names(index: Path) -> dict[str, str]:
    """The index's ``weight_map`` (tensor -> shard file), each shard a file of the index's
    own directory: an absolute path or a ``..`` would read weights from elsewhere."""
    raw = load_json(index)
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise EDSDError(f"{index}: not a valid safetensors index ('weight_map' must map tensor names to file names)")
    for shard in set(weight_map.values()):
        parts = PurePosixPath(shard).parts
        if not shard or PurePosixPath(shard).is_absolute() or ".." in parts or "\\" in shard:
            raise EDSDError(f"{index}: shard {shard!r} is outside the checkpoint's directory")
    return weight_map


def weight_files(path: str | Path) -> list[Path]:
    """The weight files of a checkpoint directory, in a fixed order."""
    path = Path(path)
    index = path / SAFETENSORS_INDEX
    if index.is_file():
        files = sorted(set(_shard_names(index).values()))
        missing = [f for f in files if not (path / f).is_file()]
        if missing:
            raise EDSDError(f"{index}: shard(s) listed but missing: {', '.join(missing)}")
        return [path / f for f in files]
    if (path / SAFETENSORS).is_file():
        return [path / SAFETENSORS]
    if (path / PYTORCH_BIN).is_file():
        return [path / PYTORCH_BIN]
    raise EDSDError(f"{path}: no weights found ({SAFETENSORS}, {SAFETENSORS_INDEX} or {PYTORCH_BIN})")


def finished_checkpoint(path: str | Path) -> bool:
    """``path`` holds a config.json and every weight file it needs: what an interrupted writer
    leaves (a config.json without weights, a missing shard) is not a finished checkpoint."""
    path = Path(path)
    if not (path / "config.json").is_file():
        return False
    try:
        weight_files(path)
    except EDSDError:
        return False
    return True


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


def torch_load_failure(exc: BaseException) -> str:
    """What ``torch.load`` found wrong, in one line. A weights-only refusal wraps its reason (an
    unsupported global, a bad opcode) in advice to turn ``weights_only`` off, which must stay
    on, and a pointer to torch's documentation: the reason is what follows "WeightsUnpickler
    error:" or, where torch leaves that out, the last line before the pointer, up to its own
    advice."""
    text = str(exc)
    if not text.lstrip().startswith("Weights only load failed"):
        return first_line(exc)
    head, marker, tail = text.partition("WeightsUnpickler error:")
    lines = [line.strip() for line in (tail if marker else head).splitlines()
             if line.strip() and not line.strip().startswith("Check the documentation")]
    if not lines:
        return first_line(exc)
    return (lines[0] if marker else lines[-1]).split(". ")[0][:300]


def _load_bin(file: Path) -> dict[str, torch.Tensor]:
    try:
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:
        raise EDSDError(
            f"{file}: cannot be loaded safely as a tensor dictionary ({type(exc).__name__}: {torch_load_failure(exc)})"
        ) from exc
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
                yield name, _get_tensor(f, file, name)


def tensor_files(path: str | Path) -> dict[str, Path]:
    """Which file holds each tensor, opening no shard of a sharded checkpoint (its index says)."""
    path = Path(path)
    index = path / SAFETENSORS_INDEX
    if index.is_file():
        weight_files(path)  # the shards exist
        return {name: path / shard for name, shard in _shard_names(index).items()}
    files: dict[str, Path] = {}
    for file in weight_files(path):
        names = _load_bin(file).keys() if file.suffix == ".bin" else _safetensors_names(file)
        files.update(dict.fromkeys(names, file))
    return files


def _safetensors_names(file: Path) -> list[str]:
    with _open_safetensors(file) as f:
        return list(f.keys())


def safetensors_metadata(file: Path) -> dict[str, str]:
    """The string metadata of a safetensors file's header, reading no tensor data; a truncated
    or corrupt file is one error naming it."""
    with _open_safetensors(file) as f:
        return f.metadata() or {}


def read_safetensors(file: Path) -> dict[str, torch.Tensor]:
    """Every tensor of one safetensors file, errors naming the file."""
    with _open_safetensors(file) as f:
        return {name: _get_tensor(f, file, name) for name in f.keys()}


def read_tensor(file: Path, name: str) -> torch.Tensor:
    """One tensor of one weight file, reading no other tensor's data."""
    if file.suffix == ".bin":
        return _load_bin(file)[name]
    with _open_safetensors(file) as f:
        if name not in f.keys():
            raise EDSDError(f"{file}: the index lists tensor '{name}' here, but the file does not hold it")
        return _get_tensor(f, file, name)


def _get_tensor(handle, file: Path, name: str) -> torch.Tensor:
    try:
        return handle.get_tensor(name)
    except Exception as exc:
        raise EDSDError(f"{file}: tensor '{name}' cannot be read, the file is truncated or corrupt ({exc})") from None


_SCRATCH = re.compile(r"\.(?P<name>.+)\.(?P<kind>partial|old|tmp)-(?P<pid>\d+)-[0-9a-f]+")


def scratch_path(path: Path, kind: str) -> Path:
    """A fresh name beside ``path`` for work in progress (``kind``: partial, old or tmp), unique
    across processes and runs; it carries this process's id so that a later run can tell
    whose it is."""
    return path.with_name(f".{path.name}.{kind}-{os.getpid()}-{secrets.token_hex(6)}")


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale_partials(path: Path) -> None:
    """Delete the unfinished outputs (``.partial``/``.tmp``) that a killed run left beside
    ``path``; those of a run still going are left alone. An ``.old`` one (a replaced output
    whose replacement was cut off) may be the only copy of it and is kept."""
    if not path.parent.is_dir():
        return
    for entry in path.parent.iterdir():
        match = _SCRATCH.fullmatch(entry.name)
        if (match and match["name"] == path.name and match["kind"] != "old"
                and not _process_alive(int(match["pid"]))):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)


def _claim(dst: Path) -> None:
    """Create ``dst`` as an empty directory, atomically: fails if anything is there."""
    try:
        os.mkdir(dst)
    except FileExistsError:
        raise EDSDError(f"{dst}: already exists (use --force to replace it)") from None


def _place(tmp: Path, dst: Path) -> None:
    """Move the finished ``tmp`` to ``dst``, which must not exist: one rename onto an empty
    directory claimed just before, so nothing another process put at ``dst`` is replaced."""
    _claim(dst)
    try:
        os.rename(tmp, dst)
    except OSError:
        try:
            os.rmdir(dst)  # only while still empty: what someone else wrote there stays
        except OSError:
            pass
        raise EDSDError(f"{dst}: appeared while the output was being written; left as it is") from None


def _replace(tmp: Path, dst: Path, check: Callable[[Path, Path], None] | None) -> None:
    """Move ``dst`` aside by one rename, check what was moved (not what was there earlier),
    then put ``tmp`` in its place; a refused one goes back where it was."""
    old = scratch_path(dst, "old")
    try:
        os.rename(dst, old)
    except FileNotFoundError:
        _place(tmp, dst)
        return
    try:
        if check is not None:
            check(old, dst)
        _place(tmp, dst)
    except BaseException:
        try:
            os.rename(old, dst)  # back where it was; if ``dst`` was taken meanwhile it stays at ``old``
        except OSError:
            pass
        raise
    if old.is_dir() and not old.is_symlink():
        shutil.rmtree(old, ignore_errors=True)
    else:
        old.unlink()


@contextmanager
def atomic_directory(
    dst: str | Path, *, force: bool = False, replaceable: Callable[[Path, Path], None] | None = None,
) -> Iterator[Path]:
    """Build a directory in a fresh sibling and move it to ``dst`` by rename, only on success.

    A failure leaves nothing at ``dst``. Without ``force`` nothing at ``dst`` is ever replaced;
    with it, what is at ``dst`` when the output is ready is replaced if ``replaceable(moved,
    dst)`` does not raise. Directories and files follow the umask.
    """
    dst = Path(dst)
    if dst.exists() and not force:  # early, before the work; the rename decides
        raise EDSDError(f"{dst}: already exists (use --force to replace it)")
    dst.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(dst)
    tmp = scratch_path(dst, "partial")
    os.mkdir(tmp)
    try:
        yield tmp
        if force:
            _replace(tmp, dst, replaceable)
        else:
            _place(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def file_hash(path: Path, chunk: int = 1 << 20):
    """A SHA-256 fed the file a MiB at a time (a large data or weight file is never held whole),
    open to more input from the caller."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest


def replace_file(path: str | Path, write: Callable[[Path], None]) -> None:
    """``write(tmp)`` to a fresh sibling, then rename it onto ``path``: readers see the old file
    or the new one, never a partial one, and concurrent writers do not share a temporary name."""
    path = Path(path)
    remove_stale_partials(path)
    tmp = scratch_path(path, "tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def save_safetensors(
    tensors: dict[str, torch.Tensor], file: str | Path, metadata: dict[str, str] | None = None
) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(file), metadata=metadata or {"format": "pt"})
    os.chmod(file, 0o666 & ~_umask())  # safetensors creates its files 0600; ours follow the umask like any other


def _umask() -> int:
    """This process's umask, read without changing it where Linux shows it."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_checkpoint(path: str | Path, config: dict, tensors: dict[str, torch.Tensor]) -> None:
    """``config.json`` + ``model.safetensors`` into ``path``, the weights first: config.json is
    written last, so a run cut off here leaves no config.json that seems to have weights."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    replace_file(path / SAFETENSORS, lambda tmp: save_safetensors(tensors, tmp))
    replace_file(path / "config.json", lambda tmp: tmp.write_text(json.dumps(config, indent=2) + "\n"))


def cast_floating(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Floating-point tensors cast to ``dtype``; integer and bool ones (``d2t``, ``t2d``) kept as they are."""
    return {k: v.detach().to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}


def cast_checkpoint(src: str | Path, dst: str | Path, dtype: torch.dtype) -> None:
    """Copy a ``config.json`` + safetensors checkpoint with its floating tensors cast to ``dtype``."""
    src = Path(src)
    config = load_json(src / "config.json")
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    tensors = cast_floating(dict(iter_tensors(src)), dtype)
    with atomic_directory(dst, force=True) as tmp:
        write_checkpoint(tmp, config, tensors)
