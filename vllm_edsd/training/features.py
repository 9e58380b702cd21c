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
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from tqdm import tqdm

from vllm_edsd.checkpoint.files import replace_file
from vllm_edsd.data import Conversation, render_many
from vllm_edsd.errors import EDSDError
from vllm_edsd.target.hidden_states import TransformersFeatures, load_target
from vllm_edsd.target.vllm_features import VLLMFeatures, unavailable_reason

SHARD_SIZE = 64
BACKENDS = ("auto", "vllm", "transformers")  # auto: vLLM where it can extract, else transformers
CACHE_FORMAT = 2  # bump when a record's fields change: the key then misses old caches
# A batch's fields and what pads them past a sample's end (no token, no loss, no target argmax).
PAD = {"input_ids": 0, "loss_mask": False, "aux": 0, "final": 0, "target_argmax": -1, "target_entropy": 0}


def tokenize_conversations(
    tokenizer, conversations: list[Conversation], max_length: int
) -> tuple[list[tuple[list[int], list[int]]], int]:
    """Rendered samples that contain at least two tokens to learn, and how many conversations
    the chat template could not render."""
    samples, skipped = render_many(tokenizer, conversations, max_length)
    return [(ids, mask) for ids, mask in samples if sum(mask[2:]) >= 2], skipped


def feature_key(target: str, layer_ids: tuple[int, ...], dtype: str, backend: str = "transformers") -> str:
    """What every shard's features depend on besides its samples: format, target, layers, dtype,
    and the engine that ran the target (vLLM's kernels round differently; transformers' shards
    keep the keys they had before vLLM could extract)."""
    engine = [] if backend == "transformers" else [backend]
    return json.dumps([CACHE_FORMAT, str(Path(target).resolve()), list(layer_ids), dtype, *engine])


def shard_path(cache_dir: Path, key: str, chunk: list[tuple[list[int], list[int]]]) -> Path:
    """A shard's file, named by its content: runs on the same samples (a prefix of a larger
    set, or another method with the same feature layers) find and reuse it."""
    digest = hashlib.sha256(key.encode())
    for ids, mask in chunk:
        digest.update(json.dumps([ids, mask]).encode())
    return cache_dir / f"shard-{digest.hexdigest()[:20]}.pt"


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
                                device=device)


def shard_paths(cache_dir: Path, key: str, samples: list[tuple[list[int], list[int]]]) -> list[Path]:
    """The shard files of ``samples`` (SHARD_SIZE each, in order), whether extracted yet or not."""
    return [shard_path(cache_dir, key, samples[start : start + SHARD_SIZE])
            for start in range(0, len(samples), SHARD_SIZE)]


def extract_features(
    source, samples: list[tuple[list[int], list[int]]], cache_dir: Path, *, key: str = ""
) -> list[Path]:
    """Shard files of target features for ``samples`` (SHARD_SIZE each, in order) in
    ``cache_dir``; shards already there (same ``key`` and samples) are reused, not recomputed.
    ``source`` computes the features (``TransformersFeatures`` or ``VLLMFeatures``, an open
    context: vLLM's engine starts only when a shard is missing)."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    shards, new_positions, started = shard_paths(cache_dir, key, samples), 0, time.time()
    for start, path in tqdm(list(zip(range(0, len(samples), SHARD_SIZE), shards)),
                            desc=f"target features ({source.backend})", unit="shard"):
        if path.exists():
            continue
        chunk = sorted(samples[start : start + SHARD_SIZE], key=lambda sample: len(sample[0]))  # little padding
        found = source.features([tokens for tokens, _ in chunk])
        new_positions += sum(len(tokens) for tokens, _ in chunk)
        records = [{
            "input_ids": torch.tensor(tokens, dtype=torch.int32),
            "loss_mask": torch.tensor(mask, dtype=torch.bool),
            "aux": f.aux.to(torch.bfloat16).cpu(),
            "final": f.final.to(torch.bfloat16).cpu(),
            "target_argmax": f.argmax.to(torch.int32).cpu(),
            "target_entropy": f.entropy.float().cpu(),
        } for (tokens, mask), f in zip(chunk, found)]
        replace_file(path, lambda tmp: torch.save(records, tmp))  # noqa: B023 (called at once)
    if new_positions:
        seconds = time.time() - started  # with the engine's start-up, as a user waits for it
        print(f"target features ({source.backend}): {new_positions:,} positions in {seconds:.0f} s, "
              f"{new_positions / seconds:,.0f} positions/s")
    return shards


def aux_columns(stored: tuple[int, ...], wanted: tuple[int, ...], hidden_size: int) -> torch.Tensor:
    """Indices of ``wanted``'s layers in features stored for the layers ``stored`` (in order)."""
    return torch.cat([torch.arange(hidden_size) + stored.index(layer) * hidden_size for layer in wanted])


def iterate_batches(
    shards: list[Path], batch_size: int, generator: torch.Generator, columns: torch.Tensor | None = None
) -> Iterator[dict[str, torch.Tensor]]:
    """Right-padded batches in a seeded random order: shards shuffled, and within a shard
    samples of similar length batched together (little padding), the batches shuffled.
    ``columns`` picks the drafter's layers out of features stored for more (``aux_columns``)."""
    for shard_index in torch.randperm(len(shards), generator=generator).tolist():
        records = torch.load(shards[shard_index], weights_only=True)
        if columns is not None:  # once per shard, before padding copies them
            for record in records:
                record["aux"] = record["aux"][:, columns]
        order = torch.randperm(len(records), generator=generator).tolist()
        order.sort(key=lambda i: len(records[i]["input_ids"]))  # stable: ties keep the random order
        batches = [order[b : b + batch_size] for b in range(0, len(order), batch_size)]
        for pick in torch.randperm(len(batches), generator=generator).tolist():
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
