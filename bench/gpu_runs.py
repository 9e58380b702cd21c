"""``python -m bench.gpu_runs``: the learning curve's work carried to and from a GPU machine
without vLLM (``scripts/draft_layer_10k_gpu.sh``).

- ``slice WORK DIR N``: the curve's prompts cut into at most N files of whole regeneration
  chunks, so that N processes answering one file each write the very cache files one run would
  (a chunk's key is its conversations, the target and the answer length).
- ``pack WORK DIR``: the regenerated data, EDSelect's layers and each training run's newest
  checkpoint (``final``, else its last epoch) with its log, in one tar.xz cut into parts small
  enough to travel (``PART_BYTES``); weights in float16, their dtype recorded.
- ``unpack DIR --work WORK``: the parts joined and extracted into WORK, weights back in their
  own dtype, so that ``bench learning-curve`` finds every run trained and measures it; each
  run is marked (``carried.json``), and the curve's report marks its row as float16-rounded.
- ``seed [DIR] --work WORK``: a GPU run's data kept in the repository (answers as ``.jsonl.xz``,
  EDSelect's ``layers.json``; DIR defaults to ``KEPT_RUN``) put into WORK where missing, so the
  curve's regeneration and EDSelect stages find them done.
"""

from __future__ import annotations

import argparse
import io
import json
import lzma
import math
import sys
import tarfile
from pathlib import Path

from vllm_edsd.checkpoint.files import replace_file
from vllm_edsd.errors import EDSDError

from .learning_curve import CARRIED

PART_BYTES = 15 << 20  # below the GPU machine's 16 MiB a file
PACKED = "learning-curve.tar.xz"
MANIFEST = "manifest.json"
KEPT_RUN = Path(__file__).parent / "results" / "learning-curve-draft-layer-10k-h200"  # the 10k answers and layers


def curve_plan(work: Path, conversations: int | None):
    """The learning curve's plan for the draft-layer-10k data (or a trial's ``conversations``)."""
    from vllm_edsd.demo import build
    from vllm_edsd.pipeline.config import read_toml

    from .learning_curve import demo_plan

    recipe = read_toml(build.PIPELINE)["data"]  # the demo's data: every usable conversation of the wheel
    chat, code = (conversations, 0) if conversations else (recipe["sharegpt_chat"], recipe["sharegpt_code"])
    args = argparse.Namespace(work=str(work), device="cuda", chat_prompts=chat, code_prompts=code)
    return demo_plan(args, chat + code)


def slice_prompts(work: Path, out: Path, slices: int, conversations: int | None) -> list[Path]:
    """The prompts in at most ``slices`` files of whole ``REGENERATE_CHUNK``s."""
    from vllm_edsd.regeneration.answers import REGENERATE_CHUNK

    plan = curve_plan(work, conversations)
    if plan.data().is_file():
        print(f"{plan.data()} is there: nothing to answer")
        return []
    if not plan.prompts().is_file():
        plan.write_prompts()
    lines = [line for line in plan.prompts().read_text().splitlines(keepends=True) if line.strip()]
    parts = whole_chunks(lines, slices, REGENERATE_CHUNK)
    paths = [out / f"slice-{i:02d}.jsonl" for i in range(len(parts))]
    for path, part in zip(paths, parts):
        path.write_text("".join(part))
    print(f"{len(lines)} prompts in {len(paths)} slices of at most {len(parts[0])}")
    return paths


def whole_chunks(items: list, slices: int, chunk: int) -> list[list]:
    """``items`` in at most ``slices`` consecutive parts, each a whole number of ``chunk``s but
    the last."""
    per = max(math.ceil(math.ceil(len(items) / chunk) / slices), 1) * chunk
    return [items[start : start + per] for start in range(0, len(items), per)]


def newest_checkpoint(run: Path) -> Path | None:
    """A run's ``final`` checkpoint, else its last finished epoch's."""
    from vllm_edsd.checkpoint.files import finished_checkpoint

    epochs = sorted(run.glob("epoch_*"), key=lambda p: int(p.name.split("_")[1]))
    return next((p for p in [run / "final", *reversed(epochs)] if finished_checkpoint(p)), None)


def half_weights(path: Path) -> tuple[bytes, dict[str, str]]:
    """A safetensors file with its floating tensors in float16, and each tensor's own dtype."""
    import torch
    from safetensors.torch import save

    from vllm_edsd.checkpoint.files import cast_floating, read_safetensors

    tensors = read_safetensors(path)
    dtypes = {name: str(t.dtype).removeprefix("torch.") for name, t in tensors.items()}
    return save(cast_floating(tensors, torch.float16)), dtypes


def add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def pack(work: Path, out: Path) -> list[Path]:
    """Everything ``unpack`` needs into ``out``: parts of one tar.xz."""
    manifest: dict = {"runs": {}, "dtypes": {}}
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:xz", preset=1) as tar:
        for path in [*work.glob("regenerated-*.jsonl"), work / "layers.json"]:
            if path.is_file():
                tar.add(path, arcname=path.name)
        for run in sorted(p.parent for p in work.glob("curve/*/*/train_log.jsonl")):
            checkpoint, name = newest_checkpoint(run), str(run.relative_to(work))
            manifest["runs"][name] = checkpoint.name if checkpoint else None
            tar.add(run / "train_log.jsonl", arcname=f"{name}/train_log.jsonl")
            for file in sorted(checkpoint.iterdir()) if checkpoint else []:
                arcname = f"{name}/{checkpoint.name}/{file.name}"
                if file.suffix == ".safetensors":
                    data, manifest["dtypes"][arcname] = half_weights(file)
                    add_bytes(tar, arcname, data)
                else:
                    tar.add(file, arcname=arcname)
        add_bytes(tar, MANIFEST, json.dumps(manifest, indent=1).encode())
    data = buffer.getvalue()
    out.mkdir(parents=True, exist_ok=True)
    parts = [out / f"{PACKED}.{i:02d}" for i in range(math.ceil(len(data) / PART_BYTES))]
    for i, part in enumerate(parts):
        part.write_bytes(data[i * PART_BYTES : (i + 1) * PART_BYTES])
    print(f"packed {len(data) / 2**20:.1f} MiB in {len(parts)} parts: "
          + ", ".join(f"{run} ({ckpt or 'no checkpoint'})" for run, ckpt in manifest["runs"].items()))
    return parts


def unpack(folder: Path, work: Path) -> dict:
    """The parts in ``folder`` extracted into ``work``, each weight back in its recorded dtype."""
    import torch

    from vllm_edsd.checkpoint.files import read_safetensors, save_safetensors

    parts = sorted(folder.glob(f"{PACKED}.*"))
    if not parts:
        raise EDSDError(f"{folder}: no {PACKED}.NN parts (what scripts/draft_layer_10k_gpu.sh packs)")
    data = b"".join(part.read_bytes() for part in parts)
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:xz") as tar:
            tar.extractall(work, filter="data")
    except (tarfile.TarError, EOFError, lzma.LZMAError) as exc:
        raise EDSDError(f"{folder}: the parts do not join into one archive ({exc}); is one missing?") from None
    manifest = json.loads((work / MANIFEST).read_text())
    for arcname, dtypes in manifest["dtypes"].items():
        path = work / arcname
        tensors = {name: t.to(getattr(torch, dtypes[name])) for name, t in read_safetensors(path).items()}
        replace_file(path, lambda tmp, tensors=tensors: save_safetensors(tensors, tmp))
    for run, checkpoint in manifest["runs"].items():
        print(f"{work / run}: {checkpoint or 'no checkpoint'}")
        if checkpoint:  # the learning curve's report says these weights went through float16
            (work / run / CARRIED).write_text(json.dumps({"weights_rounded_to": "float16"}) + "\n")
    return manifest


def seed(folder: Path, work: Path) -> list[Path]:
    """``folder``'s answers and EDSelect's layers copied into ``work`` where missing."""
    if not folder.is_dir():
        raise EDSDError(f"{folder}: no such folder")
    work.mkdir(parents=True, exist_ok=True)
    seeded = []
    for source in [*sorted(folder.glob("*.jsonl.xz")), folder / "layers.json"]:
        target = work / source.name.removesuffix(".xz")
        if source.is_file() and not target.exists():
            data = lzma.decompress(source.read_bytes()) if source.suffix == ".xz" else source.read_bytes()
            replace_file(target, lambda tmp, data=data: tmp.write_bytes(data))
            seeded.append(target)
    print(f"seeded {work} from {folder}: " + (", ".join(p.name for p in seeded) or "everything was there"))
    return seeded


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_runs", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    verbs = parser.add_subparsers(dest="verb", required=True)
    cut = verbs.add_parser("slice", help="the prompts in files of whole regeneration chunks")
    cut.add_argument("work", type=Path)
    cut.add_argument("out", type=Path)
    cut.add_argument("slices", type=int)
    cut.add_argument("--conversations", type=int, help="a trial's number of chat prompts")
    packing = verbs.add_parser("pack", help="the data and the runs' checkpoints into parts")
    packing.add_argument("work", type=Path)
    packing.add_argument("out", type=Path)
    unpacking = verbs.add_parser("unpack", help="the parts back into a work directory")
    unpacking.add_argument("folder", type=Path)
    unpacking.add_argument("--work", type=Path, required=True)
    seeding = verbs.add_parser("seed", help="a GPU run's kept data into a work directory")
    seeding.add_argument("folder", type=Path, nargs="?", default=KEPT_RUN,
                         help=f"the kept run (default: {KEPT_RUN.relative_to(Path(__file__).parent.parent)})")
    seeding.add_argument("--work", type=Path, required=True)
    args = parser.parse_args(argv)
    try:
        if args.verb == "slice":
            slice_prompts(args.work, args.out, args.slices, args.conversations)
        elif args.verb == "pack":
            pack(args.work, args.out)
        elif args.verb == "seed":
            seed(args.folder, args.work)
        else:
            unpack(args.folder, args.work)
    except EDSDError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
