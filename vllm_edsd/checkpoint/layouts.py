"""How a drafter checkpoint is written, described once per layout (each method's folder holds
its own: ``methods/edsd/layouts.py``, ``methods/eagle3/layouts.py``).

A layout is a way of writing the same drafter: its architecture name, its config fields and
its tensor names. Tensor names are mapped to the *canonical* names (the parameter names of the
method's PyTorch model) by one declarative table per layout, the way vLLM's ``WeightsMapper``
maps a checkpoint onto a model; nothing else renames tensors.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm_edsd.errors import EDSDError


@dataclass(frozen=True)
class NameMap:
    """Checkpoint tensor name -> canonical name. ``exact`` renames whole names; anything not
    listed keeps its name. The inverse is derived, so a table is written once."""

    exact: Mapping[str, str] = field(default_factory=dict)

    def to_canonical(self, name: str) -> str:
        return self.exact.get(name, name)

    def from_canonical(self, name: str) -> str:
        return self._inverse().get(name, name)

    def _inverse(self) -> dict[str, str]:
        return {canonical: own for own, canonical in self.exact.items()}


@dataclass(frozen=True)
class Layout:
    """One checkpoint layout: how to recognise it, read its config and name its tensors."""

    name: str
    architectures: tuple[str, ...]
    names: NameMap
    # Tensors only this layout has: they identify it when the architecture name is missing.
    signature: frozenset[str]
    # Where no signature fits: whether these tensor names are this layout's.
    recognise: Callable[[set[str]], bool] | None = None
    # The config class its config.json is read into: ``config.from_dict(raw, source=...,
    # layer_id_convention=...)`` after ``translate_config``; None where the project reads none.
    config: Any = None
    # raw config.json -> the form ``config`` validates (identity if already).
    translate_config: Callable[[dict, str], dict] = lambda raw, source: raw
    # a config -> config.json, for the layouts this project writes.
    write_config: Callable[[Any, str], dict] | None = None
    describe: str = ""

    @property
    def architecture(self) -> str:
        return self.architectures[0]

    def read_config(self, raw: dict, *, source: str, layer_id_convention: str | None = None) -> Any:
        translated = self.translate_config(raw, source)
        if self.config is None:
            raise EDSDError(f"{source}: vllm-edsd does not read the config of {self.describe}")
        return self.config.from_dict(translated, source=source, layer_id_convention=layer_id_convention)

    def config_json(self, cfg: Any) -> dict:
        if self.write_config is None:
            raise EDSDError(f"vllm-edsd reads {self.describe} but does not write it")
        return self.write_config(cfg, self.architecture)

    def rename_from_canonical(self, tensors: Mapping) -> dict:
        return {self.names.from_canonical(k): v for k, v in tensors.items()}

    def rename_to_canonical(self, tensors: Mapping) -> dict:
        return {self.names.to_canonical(k): v for k, v in tensors.items()}


def detect_layout(raw: dict, tensor_names: Iterable[str], layouts: Iterable[Layout], *, source: str) -> Layout:
    """Which of ``layouts`` a drafter is in: by its architecture name, else by its tensor names
    (each layout's ``signature``, else its ``recognise``)."""
    layouts = tuple(layouts)
    archs = raw.get("architectures") or []
    for layout in layouts:
        if any(a in layout.architectures for a in archs):
            return layout
    names = set(tensor_names)
    for layout in layouts:
        if layout.signature and layout.signature <= names:
            return layout
    for layout in layouts:
        if layout.recognise is not None and layout.recognise(names):
            return layout
    known = ", ".join(a for layout in layouts for a in layout.architectures)
    raise EDSDError(
        f"{source}: not an EDSD drafter: architectures={archs} and no EDFuse tensors "
        f"(edfuse.*, embnorm.weight); known architectures: {known}"
    )


# Tensors exporters write beside the weights: RoPE caches (never read; vLLM's loaders drop them)
# and KV-cache quantization scales (vLLM loads them when the drafter's KV cache is quantized).
ROPE_CACHES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
KV_SCALE = re.compile(r"\.(q|k|v|kv)_scale$")
_QUANTIZATION_SUFFIXES = ("_scale", "_zero_point", ".qweight", ".qzeros", ".scales", ".g_idx")


def is_side_tensor(name: str) -> bool:
    """Accepted beside the drafter's weights, never required: a RoPE cache or a KV-cache scale."""
    return name.endswith(ROPE_CACHES) or KV_SCALE.search(name) is not None


def unexpected_hint(name: str) -> str:
    """What an unexpected tensor most likely is, said so that a user can act on it."""
    if name.endswith(_QUANTIZATION_SUFFIXES):
        return " (a weight-quantization tensor: quantized EDSD drafters are not supported; serve an unquantized one)"
    if name == "midlayer.hidden_norm.weight":
        return " (midlayer.hidden_norm belongs to EAGLE-3 and SpecForge drafters, not to this layout)"
    return ""
