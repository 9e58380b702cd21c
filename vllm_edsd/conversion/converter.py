"""EDSD drafters as they exist in the wild (this project's training layout, SpecForge's
``EdsdDraftModel``) → the layout vLLM serves (docs/formats.md).

Everything is validated before anything is written: the config, every tensor's name and
shape (from the safetensors header), ``d2t``/``t2d`` against the vocabulary sizes, and, with a
target, the drafter against the target. Tensors are then read one at a time, checked for
NaN/Inf, renamed through the source layout's table, cast, and written into a directory that
appears at ``dst`` only when it is complete. Only the drafter's weight files are read:
``training_state.pt`` beside them (optimizer state, a pickle) is never opened.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from vllm_edsd.checkpoint.files import (
    SAFETENSORS,
    SUPPORTED_DTYPES,
    atomic_directory,
    cast_floating,
    finished_checkpoint,
    iter_tensors,
    load_json,
    read_tensor,
    tensor_files,
    tensor_shapes,
    write_checkpoint,
)
from vllm_edsd.checkpoint.layouts import ROPE_CACHES, Layout
from vllm_edsd.checkpoint.target import LAYER_ID_CONVENTIONS, TargetFingerprint, read_config_json, text_config
from vllm_edsd.checkpoint.vocab_map import check_vocab_mapping
from vllm_edsd.errors import EDSDError
from vllm_edsd.methods import EDSD_METHOD, detect_layout
from vllm_edsd.methods.blocks import DTYPES
from vllm_edsd.methods.eagle3.layouts import EAGLE3_LAYOUT
from vllm_edsd.methods.edsd.config import (
    DEFAULT_SPECULATIVE_TOKENS,
    FOLD_CONFLICT,
    EDSDConfig,
    Speculators,
    check_speculative_tokens,
)
from vllm_edsd.methods.edsd.layouts import EDSD_VLLM
from vllm_edsd.methods.edsd.model import check_tensors, token_norm
from vllm_edsd.version import __version__

TOKEN_NORM_PREFIX = "edfuse.token_norm."
EMBEDDING = "embed_tokens.weight"
# SpecForge's training loop writes one folder per save: <out>/epoch_{e}_step_{s}/.
SPECFORGE_SAVE = re.compile(r"epoch_(\d+)_step_(\d+)")


@dataclass
class Summary:
    """What a conversion produced, for the one-screen report."""

    src: str
    dst: str
    layout: str
    parameters: int
    dtype: str
    vocab_size: int
    draft_vocab_size: int
    source_layer_ids: list[int]
    source_convention: str
    vllm_layer_ids: list[int]
    token_norm: str
    folded: bool
    embedding: str
    target: TargetFingerprint | None
    num_speculative_tokens: int
    speculators: Speculators | None

    def _served_alone(self) -> str:
        """``vllm serve DST`` when config.json names the verifier, else how to make it so."""
        if self.speculators is None:
            return ("not set up: the verifier (the target vLLM loads for it) is unknown; convert again with "
                    "--verifier NAME_OR_PATH or --target DIR to write the speculators block (docs/formats.md)")
        return f"vllm serve {self.dst}  (loads the verifier {self.speculators.verifier}; speculators format)"

    def _target_checked(self) -> str:
        """What was checked against the target: its sizes, and its layers where its config counts them."""
        if self.target is None:
            return "not checked (pass --target)"
        layers = self.target.num_hidden_layers
        return (f"checked: vocab {self.target.vocab_size}, hidden {self.target.hidden_size}, "
                + ("layer count not in its config.json (aux layer ids unchecked)" if layers is None
                   else f"{layers} layers"))

    def render(self) -> str:
        norm = f"{self.token_norm}, " + (
            "folded into a draft-owned embedding table" if self.folded else "kept; embedding shared with the target"
        )
        spec = {"method": EDSD_METHOD.name, "model": self.dst, "num_speculative_tokens": self.num_speculative_tokens}
        return "\n".join([
            f"converted   {self.src} ({self.layout})",
            f"        ->  {self.dst}",
            f"parameters  {self.parameters:,} ({self.dtype})",
            f"vocabulary  draft {self.draft_vocab_size:,} of target {self.vocab_size:,}",
            f"aux layers  {self.source_layer_ids} ({self.source_convention}) = "
            f"{self.vllm_layer_ids} in vLLM's convention",
            f"token norm  {norm}",
            f"embedding   {self.embedding}",
            f"target      {self._target_checked()}",
            f"serve with  --speculative-config {json.dumps(spec)}",
            f"or alone    {self._served_alone()}",
        ])


def resolve_source(src: Path) -> Path:
    """``src`` itself, or, for a SpecForge output directory without a config of its own,
    its latest ``epoch_*_step_*`` save."""
    if not src.is_dir() or (src / "config.json").is_file():
        return src
    saves = [
        (tuple(map(int, m.groups())), p)
        for p in src.iterdir()
        if (m := SPECFORGE_SAVE.fullmatch(p.name)) and p.is_dir()
    ]
    if not saves:
        return src
    return max(saves)[1]


def _target_fingerprint(raw: dict, target: str | Path) -> TargetFingerprint:
    """The target's fingerprint from its config.json (a multimodal model's text config)."""
    source = f"{target}/config.json"
    return TargetFingerprint.from_hf_config(text_config(raw, source), source)


def _target_embedding(target: str | Path) -> torch.Tensor:
    """The target's input embedding table, the one tensor read from its checkpoint."""
    for name, file in tensor_files(target).items():
        if name.endswith("embed_tokens.weight") and "vision" not in name:
            return read_tensor(file, name)
    raise EDSDError(f"{target}: no '*embed_tokens.weight' tensor found in the target checkpoint")


def _check_same_embedding(own: torch.Tensor, target_table: torch.Tensor, source: str, target: str | Path) -> None:
    """A drafter's copy of the embedding must be its target's (up to the precision it was saved in)."""
    own, target_table = own.float(), target_table.float()
    if own.shape != target_table.shape:
        raise EDSDError(
            f"{source}: '{EMBEDDING}' has shape {list(own.shape)}, the target's table {list(target_table.shape)}"
        )
    scale = target_table.abs().max().clamp(min=1e-6)
    if ((own - target_table).abs().max() / scale) > 1e-2:
        raise EDSDError(
            f"{source}: '{EMBEDDING}' differs from the embedding of {target}: "
            "the drafter was trained for another target"
        )


@torch.no_grad()
def _fold_token_norm(embedding: torch.Tensor, tensors: dict[str, torch.Tensor], cfg: EDSDConfig) -> torch.Tensor:
    """norm(Embed(x)) depends only on x: precompute it for the whole vocabulary (in float32,
    with the reference model's own norm) and take the norm's tensors out of the drafter."""
    norm = token_norm(cfg).float()
    norm.load_state_dict({k.removeprefix(TOKEN_NORM_PREFIX): tensors.pop(k).float()
                          for k in list(tensors) if k.startswith(TOKEN_NORM_PREFIX)})
    return norm(embedding.float())


CONVERTER_NAME = "vllm-edsd"
WRITTEN_FILES = {"config.json", SAFETENSORS}


def _check_replaceable(found: Path, dst: Path) -> None:
    """``--force`` replaces only a drafter this converter wrote (finished or cut off), never
    another directory or file. ``found`` is what was at ``dst`` when the output was ready."""
    why = None
    if not found.is_dir() or found.is_symlink():
        why = "it is not a directory"
    else:
        try:
            written_by = load_json(found / "config.json")["edsd_config"]["converter"]["name"]
        except (EDSDError, OSError, KeyError, TypeError):
            written_by = None
        others = sorted(p.name for p in found.iterdir() if p.name not in WRITTEN_FILES)
        if written_by != CONVERTER_NAME:
            why = "it is not a drafter written by edsd convert"
        elif others:
            why = f"it holds files edsd convert does not write ({', '.join(others[:3])})"
    if why:
        raise EDSDError(f"{dst}: refusing to replace it with --force: {why}; remove it yourself or choose another DST")


def _check_destination(dst: Path, force: bool) -> None:
    """Refuse early what the final rename would refuse, before the work."""
    if not dst.exists() and not dst.is_symlink():
        return
    if force:
        _check_replaceable(dst, dst)
    elif dst.is_dir() and (dst / "config.json").is_file() and not finished_checkpoint(dst):
        raise EDSDError(f"{dst}: holds an unfinished output (a config.json without its weights, from an "
                        "interrupted run); use --force to replace it")
    else:
        raise EDSDError(f"{dst}: already exists (use --force to replace it)")


def provenance(path: Path) -> str:
    """A source directory as recorded in an output: its last two path components, descriptive
    without naming the machine's directories."""
    return "/".join(path.resolve().parts[-2:])


def _speculators(verifier: str | None, target: str | Path | None, target_raw: dict | None,
                 k: int) -> Speculators | None:
    """The speculators block (docs/formats.md): the verifier named, else the ``--target``
    directory; none without either. A local directory is recorded absolute, since vLLM resolves
    it from the server's working directory. The verifier's architectures are the target's."""
    name = verifier if verifier is not None else (None if target is None else str(target))
    if name is None:
        return None
    if os.path.isdir(name):
        name = os.path.abspath(name)
    architectures = (target_raw or {}).get("architectures")
    if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
        architectures = []
    return Speculators(verifier=name, num_speculative_tokens=k, verifier_architectures=tuple(architectures))


def _source_layout(src: Path, raw: dict, shapes: dict) -> Layout:
    layout = detect_layout(raw, shapes, source=f"{src}/config.json")
    if layout is EDSD_VLLM:
        raise EDSDError(f"{src}: already in the vLLM layout; serve it directly")
    if layout is EAGLE3_LAYOUT:
        raise EDSDError(f"{src}: an EAGLE-3 drafter, not EDSD: vLLM serves it as it is with \"method\": \"eagle3\"")
    return layout


def _check_options(dtype: str | None, target: str | Path | None, fold_token_norm: bool,
                   layer_id_convention: str | None, verifier: str | None, num_speculative_tokens: int) -> None:
    """Refuse bad options before anything is read."""
    if dtype is not None and dtype not in SUPPORTED_DTYPES:
        raise EDSDError(f"--dtype {dtype!r} is not supported; choose from {', '.join(SUPPORTED_DTYPES)}")
    if layer_id_convention is not None and layer_id_convention not in LAYER_ID_CONVENTIONS:
        raise EDSDError(f"--layer-id-convention {layer_id_convention!r}: choose from {', '.join(LAYER_ID_CONVENTIONS)}")
    if fold_token_norm and target is None:
        raise EDSDError("--fold-token-norm needs --target: the folded table is built from the target's embedding")
    check_speculative_tokens(num_speculative_tokens, "--num-speculative-tokens")
    if verifier is not None and not verifier.strip():
        raise EDSDError("--verifier: give the target model's directory or model hub id")


@dataclass(frozen=True)
class SourceCheckpoint:
    """A drafter to convert, validated before any tensor is read: its layout, its config (aux
    layer ids in vLLM's convention), its tensors' shapes, and its aux layer ids as it records them."""

    path: Path
    layout: Layout
    cfg: EDSDConfig
    shapes: dict
    layer_ids: list[int]
    convention: str

    @classmethod
    def read(cls, src: Path, layer_id_convention: str | None) -> SourceCheckpoint:
        """``src``'s config and tensor header, checked against each other; ``layer_id_convention``
        overrides the convention the config records."""
        raw = read_config_json(src)
        shapes = tensor_shapes(src)
        layout = _source_layout(src, raw, shapes)
        translated = layout.translate_config(raw, f"{src}/config.json")
        cfg = EDSDConfig.from_dict(translated, source=f"{src}/config.json", layer_id_convention=layer_id_convention)
        if cfg.token_norm_folded:
            raise EDSDError(f"{src}/config.json: edsd_config.token_norm_folded is true in a training checkpoint")
        edsd = translated["edsd_config"]
        convention = layer_id_convention or edsd["aux_layer_id_convention"]
        check_tensors(cfg, shapes, layout, source=str(src))
        return cls(src, layout, cfg, shapes, list(edsd["aux_layer_ids"]), convention)

    def canonical_tensors(self, progress: Callable[[Iterable, int], Iterable] | None) -> dict[str, torch.Tensor]:
        """Every tensor under its canonical name, RoPE caches left out; weights must be finite floats."""
        tensors: dict[str, torch.Tensor] = {}
        for name, tensor in (progress or (lambda it, n: it))(iter_tensors(self.path), len(self.shapes)):
            if name.endswith(ROPE_CACHES):
                continue  # recomputed from the config by every reader
            if name not in ("d2t", "t2d"):
                if not tensor.is_floating_point():
                    raise EDSDError(f"{self.path}: tensor '{name}' has dtype {tensor.dtype}; "
                                    "weights must be floating point")
                if not torch.isfinite(tensor).all():
                    raise EDSDError(f"{self.path}: tensor '{name}' contains NaN or Inf")
            tensors[self.layout.names.to_canonical(name)] = tensor
        return tensors

    def provenance(self) -> dict:
        """The metadata the output records: who converted it, from what."""
        return {
            "converter": {"name": CONVERTER_NAME, "version": __version__},
            "source": {
                "path": provenance(self.path),
                "layout": self.layout.name,
                "aux_layer_ids": self.layer_ids,
                "aux_layer_id_convention": self.convention,
            },
        }


def _shared_embedding(own: torch.Tensor | None, target_table: torch.Tensor | None, source: str,
                      target: str | Path | None) -> str:
    """How the summary describes the embedding vLLM shares with the target, after checking a
    drafter's own copy against the target's table where there is one."""
    if own is None:
        return "none in the checkpoint; vLLM shares the target's"
    if target_table is None:
        return f"'{EMBEDDING}' dropped, vLLM shares the target's (not compared: pass --target)"
    _check_same_embedding(own, target_table, source, target)
    return f"'{EMBEDDING}' equals the target's; dropped, vLLM shares the target's"


def _folded_embedding(target_table: torch.Tensor, tensors: dict[str, torch.Tensor], cfg: EDSDConfig,
                      target: str | Path) -> EDSDConfig:
    """Put the folded table (token norm of the target's embedding) into ``tensors``; the config says so."""
    if tuple(target_table.shape) != (cfg.vocab_size, cfg.hidden_size):
        raise EDSDError(
            f"{target}: embedding table has shape {list(target_table.shape)}, "
            f"expected {[cfg.vocab_size, cfg.hidden_size]}"
        )
    tensors[EMBEDDING] = _fold_token_norm(target_table, tensors, cfg)
    return cfg.with_updates(token_norm_folded=True)


def _place_embedding(tensors: dict[str, torch.Tensor], cfg: EDSDConfig, target: str | Path | None,
                     fold_token_norm: bool, source: str) -> tuple[EDSDConfig, str]:
    """The drafter's own copy of the embedding is dropped (vLLM shares the target's), or, with
    ``fold_token_norm``, replaced by the folded table. Returns the config and the summary's line."""
    own_embedding = tensors.pop(EMBEDDING, None)
    target_table = (
        _target_embedding(target) if target is not None and (fold_token_norm or own_embedding is not None) else None
    )
    embedding = _shared_embedding(own_embedding, target_table, source, target)
    if fold_token_norm:
        cfg = _folded_embedding(target_table, tensors, cfg, target)
        embedding = f"the drafter's own: {cfg.token_norm}(target embedding), {cfg.vocab_size:,} rows"
    return cfg, embedding


def convert(
    src: str | Path,
    dst: str | Path,
    *,
    dtype: str | None = None,
    target: str | Path | None = None,
    fold_token_norm: bool = False,
    layer_id_convention: str | None = None,
    verifier: str | None = None,
    num_speculative_tokens: int = DEFAULT_SPECULATIVE_TOKENS,
    force: bool = False,
    progress: Callable[[Iterable, int], Iterable] | None = None,
) -> Summary:
    """Convert ``src`` (this project's training layout or SpecForge's) into ``dst`` (vLLM layout).

    ``verifier`` (default: ``target``) and ``num_speculative_tokens`` make ``dst`` servable
    alone, ``vllm serve DST`` (docs/formats.md, "Speculators format")."""
    src, dst = resolve_source(Path(src)), Path(dst)
    source = str(src)
    _check_options(dtype, target, fold_token_norm, layer_id_convention, verifier, num_speculative_tokens)
    _check_destination(dst, force)
    checkpoint = SourceCheckpoint.read(src, layer_id_convention)
    cfg, fingerprint, target_raw = checkpoint.cfg, None, None
    if fold_token_norm and cfg.attention_reads_token:  # refused before any tensor is read
        raise EDSDError(f"--fold-token-norm: {FOLD_CONFLICT}; convert it without --fold-token-norm")
    if target is not None:
        target_raw = read_config_json(target)
        fingerprint = _target_fingerprint(target_raw, target)
        cfg.check_target(fingerprint, drafter=source)
        cfg = cfg.with_updates(target=fingerprint)

    tensors = checkpoint.canonical_tensors(progress)
    check_vocab_mapping(tensors.get("d2t"), tensors.get("t2d"), cfg.vocab_size, cfg.draft_vocab_size, source)
    cfg, embedding = _place_embedding(tensors, cfg, target, fold_token_norm, source)

    out_dtype = dtype or cfg.torch_dtype
    cfg = cfg.with_updates(
        torch_dtype=out_dtype,
        speculators=_speculators(verifier, target, target_raw, num_speculative_tokens),
        metadata=checkpoint.provenance(),
    )
    out = cast_floating(EDSD_VLLM.rename_from_canonical(tensors), DTYPES[out_dtype])
    with atomic_directory(dst, force=force, replaceable=_check_replaceable) as tmp:
        write_checkpoint(tmp, EDSD_VLLM.config_json(cfg), out)
    return Summary(
        src=source, dst=str(dst), layout=checkpoint.layout.describe, dtype=out_dtype,
        parameters=sum(t.numel() for n, t in out.items() if t.is_floating_point() and n != EMBEDDING),
        vocab_size=cfg.vocab_size, draft_vocab_size=cfg.draft_vocab_size,
        source_layer_ids=checkpoint.layer_ids, source_convention=checkpoint.convention,
        vllm_layer_ids=list(cfg.aux_layer_ids), token_norm=cfg.token_norm, folded=cfg.token_norm_folded,
        embedding=embedding, target=fingerprint, num_speculative_tokens=num_speculative_tokens,
        speculators=cfg.speculators,
    )
