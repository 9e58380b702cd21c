"""EDSD training checkpoint (SPEC §3.1) → the layout vLLM serves (SPEC §3.2).

Everything is validated before anything is written: the config, every tensor's name and
shape (from the safetensors header), ``d2t``/``t2d`` against the vocabulary sizes, and, with a
target, the drafter against the target. Tensors are then read one at a time, checked for
NaN/Inf, cast, renamed and written into a directory that appears at ``dst`` only when it is
complete.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from vllm_edsd import __version__
from vllm_edsd.checkpoint import (SAFETENSORS, atomic_directory, cast_floating, iter_tensors, save_safetensors,
                                  tensor_shapes)
from vllm_edsd.config import (
    SUPPORTED_DTYPES,
    TRAINING_ARCHITECTURE,
    TRAINING_TO_VLLM_NAMES,
    EDSDConfig,
    EDSDError,
    TargetFingerprint,
    is_vllm_layout,
    read_config_json,
)
from vllm_edsd.reference import DTYPES, check_tensors

TOKEN_NORM = ("edfuse.token_norm.weight", "edfuse.token_norm.bias")


@dataclass
class Summary:
    """What a conversion produced, for the one-screen report."""

    src: str
    dst: str
    parameters: int
    dtype: str
    vocab_size: int
    draft_vocab_size: int
    source_layer_ids: list[int]
    source_convention: str
    vllm_layer_ids: list[int]
    folded: bool
    target: TargetFingerprint | None

    def render(self) -> str:
        target = "not checked (pass --target)" if self.target is None else (
            f"checked: vocab {self.target.vocab_size}, hidden {self.target.hidden_size}, "
            f"{self.target.num_hidden_layers} layers"
        )
        return "\n".join([
            f"converted   {self.src}",
            f"        ->  {self.dst}",
            f"parameters  {self.parameters:,} ({self.dtype})",
            f"vocabulary  draft {self.draft_vocab_size:,} of target {self.vocab_size:,}",
            f"aux layers  {self.source_layer_ids} ({self.source_convention}) = {self.vllm_layer_ids} in vLLM's convention",
            f"token norm  {'folded into a draft-owned embedding table' if self.folded else 'kept; embedding shared with the target'}",
            f"target      {target}",
            "serve with  --speculative-config "
            + json.dumps({"method": "edsd", "model": self.dst, "num_speculative_tokens": 4}),
        ])


def _check_vocab_mapping(d2t: torch.Tensor, t2d: torch.Tensor, cfg: EDSDConfig, source: str) -> None:
    """``draft id i`` maps to ``i + d2t[i]``; those ids must be exactly the True entries of t2d."""
    if d2t.dtype not in (torch.int64, torch.int32) or t2d.dtype != torch.bool:
        raise EDSDError(f"{source}: 'd2t' must be an integer tensor and 't2d' a bool tensor (got {d2t.dtype}, {t2d.dtype})")
    ids = torch.arange(cfg.draft_vocab_size) + d2t.long()
    if ids.min() < 0 or ids.max() >= cfg.vocab_size:
        raise EDSDError(f"{source}: 'd2t' maps draft ids outside the target vocabulary 0..{cfg.vocab_size - 1}")
    if int(t2d.sum()) != cfg.draft_vocab_size:
        raise EDSDError(
            f"{source}: 't2d' marks {int(t2d.sum())} target ids but draft_vocab_size is {cfg.draft_vocab_size}"
        )
    if not torch.equal(ids, torch.nonzero(t2d).flatten()):
        raise EDSDError(f"{source}: 'd2t' and 't2d' disagree: draft id i + d2t[i] must list the ids where t2d is true, ascending")


def _target_fingerprint(target: str | Path) -> TargetFingerprint:
    raw = read_config_json(target)
    text = raw.get("text_config") or raw
    try:
        return TargetFingerprint.from_hf_config(text)
    except (KeyError, TypeError, ValueError):
        raise EDSDError(f"{target}/config.json: lacks vocab_size, hidden_size or num_hidden_layers") from None


def _target_embedding(target: str | Path) -> torch.Tensor:
    """The target's input embedding table, read tensor by tensor from its checkpoint."""
    for name, tensor in iter_tensors(target):
        if name.endswith("embed_tokens.weight") and "vision" not in name:
            return tensor
    raise EDSDError(f"{target}: no '*embed_tokens.weight' tensor found in the target checkpoint")


def _fold_token_norm(embedding: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """LN(Embed(x)) depends only on x: precompute it for the whole vocabulary."""
    return torch.nn.functional.layer_norm(embedding.float(), (embedding.shape[-1],), weight.float(), bias.float(), eps)


def convert(
    src: str | Path,
    dst: str | Path,
    *,
    dtype: str | None = None,
    target: str | Path | None = None,
    fold_token_norm: bool = False,
    layer_id_convention: str | None = None,
    force: bool = False,
    progress: Callable[[Iterable, int], Iterable] | None = None,
) -> Summary:
    """Convert ``src`` (training layout) into ``dst`` (vLLM layout); see the module docstring."""
    src, dst = Path(src), Path(dst)
    source = str(src)
    raw = read_config_json(src)
    if is_vllm_layout(raw):
        raise EDSDError(f"{src}: already in the vLLM layout; serve it directly")
    archs = raw.get("architectures") or []
    if archs and TRAINING_ARCHITECTURE not in archs:
        raise EDSDError(f"{src}: not an EDSD training checkpoint (architectures={archs}, expected {TRAINING_ARCHITECTURE})")
    if dtype is not None and dtype not in SUPPORTED_DTYPES:
        raise EDSDError(f"--dtype {dtype!r} is not supported; choose from {', '.join(SUPPORTED_DTYPES)}")
    if fold_token_norm and target is None:
        raise EDSDError("--fold-token-norm needs --target: the folded table is built from the target's embedding")
    if dst.exists() and not force:
        raise EDSDError(f"{dst}: already exists (use --force to replace it)")
    cfg = EDSDConfig.from_dict(raw, source=f"{src}/config.json", layer_id_convention=layer_id_convention)
    if cfg.token_norm_folded:
        raise EDSDError(f"{src}/config.json: edsd_config.token_norm_folded is true in a training checkpoint")
    convention = layer_id_convention or raw["edsd_config"]["aux_layer_id_convention"]
    source_ids = list(raw["edsd_config"]["aux_layer_ids"])

    shapes = tensor_shapes(src)
    check_tensors(cfg, shapes, layout="training", source=source)
    fingerprint = None
    if target is not None:
        fingerprint = _target_fingerprint(target)
        cfg.check_target(fingerprint, drafter=source)
        cfg = cfg.with_updates(target=fingerprint)
    out_dtype = dtype or cfg.torch_dtype

    tensors: dict[str, torch.Tensor] = {}
    mapping: dict[str, torch.Tensor] = {}
    names = list(shapes)
    for name, tensor in (progress or (lambda it, n: it))(iter_tensors(src), len(names)):
        if name in ("d2t", "t2d"):
            mapping[name] = tensor
        elif not tensor.is_floating_point():
            raise EDSDError(f"{source}: tensor '{name}' has dtype {tensor.dtype}; weights must be floating point")
        elif not torch.isfinite(tensor).all():
            raise EDSDError(f"{source}: tensor '{name}' contains NaN or Inf")
        tensors[name] = tensor
    if mapping:
        _check_vocab_mapping(mapping["d2t"], mapping["t2d"], cfg, source)

    if fold_token_norm:
        weight, bias = (tensors.pop(n) for n in TOKEN_NORM)
        embedding = tensors.get("embed_tokens.weight")
        embedding = _target_embedding(target) if embedding is None else embedding
        if tuple(embedding.shape) != (cfg.vocab_size, cfg.hidden_size):
            raise EDSDError(
                f"{target}: embedding table has shape {list(embedding.shape)}, expected {[cfg.vocab_size, cfg.hidden_size]}"
            )
        tensors["embed_tokens.weight"] = _fold_token_norm(embedding, weight, bias, cfg.token_norm_eps)
        cfg = cfg.with_updates(token_norm_folded=True)

    cfg = cfg.with_updates(
        torch_dtype=out_dtype,
        metadata={
            "converter": {"name": "vllm-edsd", "version": __version__},
            "source": {
                "path": str(src.resolve()),
                "layout": "edsd-training",
                "aux_layer_ids": source_ids,
                "aux_layer_id_convention": convention,
            },
        },
    )
    out = cast_floating({TRAINING_TO_VLLM_NAMES.get(name, name): t for name, t in tensors.items()}, DTYPES[out_dtype])
    with atomic_directory(dst, force=force) as tmp:
        save_safetensors(out, tmp / SAFETENSORS)
        (tmp / "config.json").write_text(json.dumps(cfg.to_vllm_dict(), indent=2) + "\n")
    return Summary(
        src=str(src), dst=str(dst), dtype=out_dtype,
        parameters=sum(t.numel() for n, t in out.items() if t.is_floating_point() and n != "embed_tokens.weight"),
        vocab_size=cfg.vocab_size, draft_vocab_size=cfg.draft_vocab_size,
        source_layer_ids=source_ids, source_convention=convention,
        vllm_layer_ids=list(cfg.aux_layer_ids), folded=cfg.token_norm_folded, target=fingerprint,
    )

