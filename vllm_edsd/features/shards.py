"""Training data for a drafter: conversations → token ids + loss masks → target features,
cached on disk in shards named by their content, so that an interrupted extraction resumes
where it stopped, and runs on a prefix of the same samples (a learning curve) or for another
method (features stored for the union of both methods' layers) reuse them.

Each cached sample keeps what training needs and nothing else: token ids, the assistant
loss mask, the aux hidden states of the chosen layers and the target's final hidden state
(the lm_head input: soft labels over the draft vocabulary are recomputed from it, far smaller
than storing logits), plus the target's argmax and full-vocabulary entropy per position,
which would otherwise cost a full-vocabulary product in every training step. Hidden states
are stored in bf16: fp16 overflows on targets with large residual values.

A shard is one safetensors file (docs/scale.md, "Feature shards"): per field of ``PAD`` its
samples' positions end to end, a ``lengths`` tensor to cut them apart, and in its header
what the features were computed from (format, layers, dtype, backend, the target's
fingerprint) with the shard's sample and position counts. Shards are read one at a time, so
memory is bounded by a shard, not by the data set; a manifest per run lists its shards.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import torch
from tqdm import tqdm

from vllm_edsd.checkpoint.files import (
    checkpoint_fingerprint,
    read_safetensors,
    replace_file,
    safetensors_metadata,
    save_safetensors,
)
from vllm_edsd.data import Conversation, render_many
from vllm_edsd.errors import EDSDError
from vllm_edsd.launch.transformers_target import load_target

from .hidden_states import TransformersFeatures
from .vllm_extraction import VLLMFeatures, unavailable_reason

SHARD_SIZE = 64
BACKENDS = ("auto", "vllm", "transformers")  # auto: vLLM where it can extract, else transformers
CACHE_FORMAT = 3  # bump when a shard's layout changes: the key then misses old caches (3: safetensors)
# A batch's fields and what pads them past a sample's end (no token, no loss, no target argmax).
PAD = {"input_ids": 0, "loss_mask": False, "aux": 0, "final": 0, "target_argmax": -1, "target_entropy": 0}


def tokenize_conversations(
    tokenizer, conversations: list[Conversation], max_length: int
) -> tuple[list[tuple[list[int], list[int]]], int, int]:
    """Rendered samples, cut to their first ``max_length`` tokens, that contain at least two
    tokens to learn; how many conversations the chat template could not render; and how many
    of the samples kept were cut."""
    rendered, skipped = render_many(tokenizer, conversations)
    learnable = [(ids, mask) for ids, mask in rendered if sum(mask[2:max_length]) >= 2]
    cut = sum(len(ids) > max_length for ids, _ in learnable)
    return [(ids[:max_length], mask[:max_length]) for ids, mask in learnable], skipped, cut


@dataclass(frozen=True)
class FeatureSpec:
    """What every shard's features depend on besides its samples: the target (its path and
    the fingerprint of its files), the layers, the dtype it ran in, and the engine that ran it
    (vLLM's kernels round differently)."""

    target: str
    fingerprint: str
    layers: tuple[int, ...]
    dtype: str
    backend: str

    @classmethod
    def of(cls, target: str | Path, layers: tuple[int, ...], dtype: str, backend: str) -> FeatureSpec:
        """The spec of features of the target directory ``target`` (its fingerprint read now)."""
        return cls(str(Path(target).resolve()), checkpoint_fingerprint(target), tuple(layers), dtype, backend)

    @property
    def key(self) -> str:
        """The spec as one string, hashed into every shard's name: a new target (or new weights
        at its path) or another format misses the shards of the old one."""
        return json.dumps([CACHE_FORMAT, self.target, self.fingerprint, list(self.layers), self.dtype, self.backend])

    def header(self) -> dict[str, str]:
        """What a shard's header records of the spec (safetensors metadata holds strings)."""
        return {"cache_format": str(CACHE_FORMAT), "layers": json.dumps(list(self.layers)), "dtype": self.dtype,
                "backend": self.backend, "target_fingerprint": self.fingerprint}


def shard_path(cache_dir: Path, spec: FeatureSpec, chunk: list[tuple[list[int], list[int]]]) -> Path:
    """A shard's file, named by its content: runs on the same samples (a prefix of a larger
    set, or another method with the same feature layers) find and reuse it."""
    digest = hashlib.sha256(spec.key.encode())
    for ids, mask in chunk:
        digest.update(json.dumps([ids, mask]).encode())
    return cache_dir / f"shard-{digest.hexdigest()[:20]}.safetensors"


def resolve_backend(backend: str, *, quiet: bool = False) -> str:
    """``vllm`` or ``transformers``: ``auto`` is vLLM where the installed vLLM can extract, else
    transformers, with one line saying why (unless ``quiet``)."""
    if backend not in BACKENDS:
        raise EDSDError(f"unknown features backend {backend!r}; choose from {', '.join(BACKENDS)}")
    if backend == "transformers":
        return backend
    reason = unavailable_reason()
    if reason is None:
        return "vllm"
    if backend == "vllm":
        raise EDSDError(f"--features-backend vllm: {reason}")
    if not quiet:
        print(f"target features through transformers: {reason}")
    return "transformers"


def feature_source(
    backend: str, target: str, layer_ids: tuple[int, ...], *, dtype: str, max_length: int, device: str,
    engine_args: dict | None = None,
) -> TransformersFeatures | VLLMFeatures:
    """What runs the target for its features (``backend`` as ``resolve_backend`` gives it;
    ``engine_args`` go to vLLM's ``LLM``)."""
    if backend == "vllm":
        return VLLMFeatures(target, layer_ids, dtype=dtype, max_length=max_length, device=device,
                            **(engine_args or {}))
    return TransformersFeatures(load_target(target, dtype=getattr(torch, dtype), device=device), layer_ids,
                                batch_size=4 if device == "cpu" else 32, device=device)


def shard_paths(cache_dir: Path, spec: FeatureSpec, samples: list[tuple[list[int], list[int]]]) -> list[Path]:
    """The shard files of ``samples`` (SHARD_SIZE each, in order), whether extracted yet or not."""
    return [shard_path(cache_dir, spec, samples[start : start + SHARD_SIZE])
            for start in range(0, len(samples), SHARD_SIZE)]


def manifest_path(cache_dir: Path, shards: list[Path]) -> Path:
    """The manifest of a run's shards, named by them (their names hold the spec and samples):
    runs sharing shards (a learning curve's prefixes, two methods) keep their own manifests."""
    digest = hashlib.sha256("\n".join(path.name for path in shards).encode())
    return cache_dir / f"manifest-{digest.hexdigest()[:20]}.json"


def write_shard(path: Path, records: list[dict[str, torch.Tensor]], spec: FeatureSpec) -> None:
    """``records`` (one dict of ``PAD``'s fields per sample) as one safetensors file, atomically."""
    tensors = {key: torch.cat([record[key] for record in records]) for key in PAD}
    tensors["lengths"] = torch.tensor([len(record["input_ids"]) for record in records], dtype=torch.int64)
    header = {**spec.header(), "samples": str(len(records)), "positions": str(int(tensors["lengths"].sum()))}
    replace_file(path, lambda tmp: save_safetensors(tensors, tmp, {"format": "pt", **header}))


def check_shard(path: Path, spec: FeatureSpec, chunk: list[tuple[list[int], list[int]]]) -> dict[str, str]:
    """The header of a shard found in the cache, if it holds ``chunk``'s features as ``spec``
    computes them; else one error naming the file and what differs."""
    try:
        header = safetensors_metadata(path)
    except EDSDError as exc:
        raise EDSDError(f"{exc}; delete the file to extract it again") from None
    expected = {**spec.header(), "samples": str(len(chunk)), "positions": str(sum(len(ids) for ids, _ in chunk))}
    for field, value in expected.items():
        if header.get(field) != value:
            raise EDSDError(f"{path}: {field} is {header.get(field, 'missing')} in the file, {value} for this run "
                            "(not this run's features: delete the file to extract it again)")
    return header


def shard_samples(path: Path) -> int:
    """How many samples a shard holds, read from its header alone."""
    samples = safetensors_metadata(path).get("samples", "")
    if not samples.isdigit():
        raise EDSDError(f"{path}: not a feature shard (its header gives no sample count)")
    return int(samples)


def read_shard(path: Path, columns: torch.Tensor | None = None) -> list[dict[str, torch.Tensor]]:
    """A shard's samples, each a dict of ``PAD``'s fields (views of the shard's tensors);
    ``columns`` picks aux columns once for the whole shard (``aux_columns``)."""
    tensors = read_safetensors(path)
    lengths = tensors.get("lengths", torch.zeros(0, dtype=torch.int64)).tolist()
    for key in PAD:
        if key not in tensors or len(tensors[key]) != sum(lengths):
            raise EDSDError(f"{path}: not a feature shard (field '{key}' missing or not {sum(lengths)} positions long)")
    if columns is not None:
        tensors["aux"] = tensors["aux"][:, columns]
    fields = {key: torch.split(tensors[key], lengths) for key in PAD}
    return [{key: fields[key][i] for key in PAD} for i in range(len(lengths))]


def write_manifest(cache_dir: Path, spec: FeatureSpec, shards: list[Path], headers: list[dict[str, str]]) -> Path:
    """The run's manifest: what its features were computed from and, per shard, its file,
    samples and positions (docs/scale.md, "Feature shards")."""
    entries = [{"file": path.name, "samples": int(header["samples"]), "positions": int(header["positions"])}
               for path, header in zip(shards, headers)]
    manifest = {"format": CACHE_FORMAT, "target": spec.target, "target_fingerprint": spec.fingerprint,
                "layers": list(spec.layers), "dtype": spec.dtype, "backend": spec.backend,
                "samples": sum(e["samples"] for e in entries), "positions": sum(e["positions"] for e in entries),
                "shards": entries}
    path = manifest_path(cache_dir, shards)
    replace_file(path, lambda tmp: tmp.write_text(json.dumps(manifest, indent=2) + "\n"))
    return path


def extract_features(
    source, samples: list[tuple[list[int], list[int]]], cache_dir: Path, spec: FeatureSpec
) -> list[Path]:
    """Shard files of target features for ``samples`` (SHARD_SIZE each, in order) in
    ``cache_dir``, and their manifest; shards already there (same ``spec`` and samples) are
    checked and reused, not recomputed. ``source`` computes the features
    (``TransformersFeatures`` or ``VLLMFeatures``, an open context: vLLM's engine starts only
    when a shard is missing)."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    shards, headers, new_positions, started = shard_paths(cache_dir, spec, samples), [], 0, time.time()
    for start, path in tqdm(list(zip(range(0, len(samples), SHARD_SIZE), shards)),
                            desc=f"target features ({source.backend})", unit="shard"):
        chunk = sorted(samples[start : start + SHARD_SIZE], key=lambda sample: len(sample[0]))  # little padding
        if not path.exists():
            write_shard(path, shard_records(source, chunk), spec)
            new_positions += sum(len(tokens) for tokens, _ in chunk)
        headers.append(check_shard(path, spec, chunk))
    if new_positions:
        seconds = time.time() - started  # with the engine's start-up, as a user waits for it
        print(f"target features ({source.backend}): {new_positions:,} positions in {seconds:.0f} s, "
              f"{new_positions / seconds:,.0f} positions/s")
    write_manifest(cache_dir, spec, shards, headers)
    return shards


def shard_records(source, chunk: list[tuple[list[int], list[int]]]) -> list[dict[str, torch.Tensor]]:
    """``chunk``'s samples with their target features, as stored: one dict of ``PAD``'s fields each."""
    found = source.features([tokens for tokens, _ in chunk])
    return [{
        "input_ids": torch.tensor(tokens, dtype=torch.int32),
        "loss_mask": torch.tensor(mask, dtype=torch.bool),
        "aux": f.aux.to(torch.bfloat16).cpu(),
        "final": f.final.to(torch.bfloat16).cpu(),
        "target_argmax": f.argmax.to(torch.int32).cpu(),
        "target_entropy": f.entropy.float().cpu(),
    } for (tokens, mask), f in zip(chunk, found)]


def aux_columns(stored: tuple[int, ...], wanted: tuple[int, ...], hidden_size: int) -> torch.Tensor:
    """Indices of ``wanted``'s layers in features stored for the layers ``stored`` (in order)."""
    return torch.cat([torch.arange(hidden_size) + stored.index(layer) * hidden_size for layer in wanted])


def iterate_batches(
    shards: list[Path], batch_size: int, generator: torch.Generator, columns: torch.Tensor | None = None,
    skip: int = 0,
) -> Iterator[dict[str, torch.Tensor]]:
    """Right-padded batches in a seeded random order: shards shuffled, and within a shard
    samples of similar length batched together (little padding), the batches shuffled.
    ``columns`` picks the drafter's layers out of features stored for more (``aux_columns``).
    One shard is held at a time: the next is read once the last one's batches are yielded.
    The first ``skip`` batches (an epoch resumed mid-way) are drawn but not yielded, and the
    shards they cover whole are not read: the generator ends as if they had been."""
    for shard_index in torch.randperm(len(shards), generator=generator).tolist():
        samples = shard_samples(shards[shard_index])
        count = batch_count(samples, batch_size)
        if skip >= count:
            _shard_draws(samples, batch_size, generator)
            skip -= count
            continue
        yield from islice(shard_batches(read_shard(shards[shard_index], columns), batch_size, generator), skip, None)
        skip = 0


def batch_count(samples: int, batch_size: int) -> int:
    """How many batches a shard of ``samples`` makes (the last one may be short)."""
    return math.ceil(samples / batch_size)


def _shard_draws(samples: int, batch_size: int, generator: torch.Generator) -> tuple[list[int], list[int]]:
    """A shard's two random draws: its samples' order and the order its batches are yielded in."""
    return (torch.randperm(samples, generator=generator).tolist(),
            torch.randperm(batch_count(samples, batch_size), generator=generator).tolist())


def shard_batches(
    records: list[dict[str, torch.Tensor]], batch_size: int, generator: torch.Generator
) -> Iterator[dict[str, torch.Tensor]]:
    """One shard's batches (``iterate_batches``), each a padded copy: none holds the shard."""
    order, picks = _shard_draws(len(records), batch_size, generator)
    order.sort(key=lambda i: len(records[i]["input_ids"]))  # stable: ties keep the random order
    batches = [order[b : b + batch_size] for b in range(0, len(order), batch_size)]
    for pick in picks:
        batch = [records[i] for i in batches[pick]]
        width = max(len(r["input_ids"]) for r in batch)

        def pad(key: str, batch=batch, width=width) -> torch.Tensor:
            first = batch[0][key]
            out = torch.full((len(batch), width, *first.shape[1:]), PAD[key], dtype=first.dtype)
            for row, record in enumerate(batch):
                out[row, : len(record[key])] = record[key]
            return out

        padded = {key: pad(key) for key in PAD}
        yield {**padded, "input_ids": padded["input_ids"].long(), "target_argmax": padded["target_argmax"].long()}


def join_batches(batches: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One batch holding the rows of ``batches`` in order, right-padded to the widest: the
    union that one process trains on in place of data-parallel ranks' batches."""
    width = max(batch["input_ids"].shape[1] for batch in batches)

    def widen(x: torch.Tensor, fill) -> torch.Tensor:
        return torch.cat([x, torch.full((x.shape[0], width - x.shape[1], *x.shape[2:]), fill, dtype=x.dtype)], 1)

    return {key: torch.cat([widen(batch[key], PAD[key]) for batch in batches]) for key in PAD}
