"""The checkpoint layouts EDSD drafters come in, each described once.

A layout is a way of writing the same drafter: its architecture name, its config fields and
its tensor names. Tensor names are mapped to the *canonical* names (the parameter names of
``vllm_edsd.model.edsd.EDSDDraftModel``) by one declarative table per layout, the way vLLM's
``WeightsMapper`` maps a checkpoint onto a model; nothing else renames tensors.

* ``EDSD_TRAINING`` — what ``edsd train`` writes (docs/formats.md): canonical names, ``edsd_config``.
* ``SPECFORGE_EDSD`` — SpecForge's ``EdsdDraftModel`` (the paper's training code): a plain
  Llama config with ``target_layer_ids`` in the "output of layer i" convention, the EDFuse
  width in ``intermediate_size``, an RMSNorm ``embnorm`` and ``midlayer.hidden_norm``.
* ``EDSD_VLLM`` — what the plugin serves (docs/formats.md); EDFuse's projections are renamed so
  vLLM's stacked gate/up loaders do not catch them.
* ``EAGLE3`` — the baseline, in the names vLLM's own ``"method": "eagle3"`` loads.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from vllm_edsd.checkpoint.config import LAYER_INPUT, LAYER_OUTPUT, RMSNORM, EDSDConfig, read_config_json
from vllm_edsd.errors import EDSDError, is_int


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
    # raw config.json -> the ``edsd_config`` form EDSDConfig validates (identity if already).
    translate_config: Callable[[dict, str], dict] = lambda raw, source: raw
    # EDSDConfig -> config.json, for the layouts this project writes.
    write_config: Callable[[EDSDConfig, str], dict] | None = None
    describe: str = ""

    @property
    def architecture(self) -> str:
        return self.architectures[0]

    def read_config(self, raw: dict, *, source: str, layer_id_convention: str | None = None) -> EDSDConfig:
        return EDSDConfig.from_dict(
            self.translate_config(raw, source), source=source, layer_id_convention=layer_id_convention
        )

    def config_json(self, cfg: EDSDConfig) -> dict:
        if self.write_config is None:
            raise EDSDError(f"vllm-edsd reads {self.describe} but does not write it")
        return self.write_config(cfg, self.architecture)

    def rename_from_canonical(self, tensors: Mapping) -> dict:
        return {self.names.from_canonical(k): v for k, v in tensors.items()}

    def rename_to_canonical(self, tensors: Mapping) -> dict:
        return {self.names.to_canonical(k): v for k, v in tensors.items()}


def _specforge_config(raw: dict, source: str) -> dict:
    """SpecForge's ``EdsdDraftModel`` config in this project's ``edsd_config`` form."""
    ids = raw.get("target_layer_ids")
    if ids is None:
        raise EDSDError(
            f"{source}: missing field 'target_layer_ids' (SpecForge EDSD drafters record their two target layers there)"
        )
    if not isinstance(ids, list) or len(ids) != 2 or not all(is_int(i) and i >= 0 for i in ids):
        raise EDSDError(
            f"{source}: field 'target_layer_ids' must list exactly two non-negative target layer ids, got {ids!r}"
        )
    if "intermediate_size" not in raw:
        raise EDSDError(f"{source}: missing field 'intermediate_size' (SpecForge's EDFuse and MLP width)")
    eps = raw.get("rms_norm_eps", 1e-6)  # transformers' LlamaConfig default
    return {
        **raw,
        "rms_norm_eps": eps,
        "edsd_config": {
            "aux_layer_ids": ids,
            "aux_layer_id_convention": LAYER_OUTPUT,
            "fuse_intermediate_size": raw["intermediate_size"],
            "token_norm": RMSNORM,
            "token_norm_eps": eps,
        },
    }


def _not_edsd(raw: dict, source: str) -> dict:
    raise EDSDError(
        f"{source}: this is an EAGLE-3 drafter (architectures={raw.get('architectures')}), not EDSD; "
        "serve it with vLLM's own \"method\": \"eagle3\""
    )


EDSD_TRAINING = Layout(
    name="edsd-training",
    architectures=("LlamaForCausalLMEDSD",),
    names=NameMap(),
    signature=frozenset({"edfuse.gate_proj.weight"}),
    write_config=EDSDConfig.to_training_dict,
    describe="an EDSD checkpoint in this project's training layout",
)
SPECFORGE_EDSD = Layout(
    name="specforge-edsd",
    architectures=("EdsdDraftModel",),
    names=NameMap({
        "embnorm.weight": "edfuse.token_norm.weight",
        "midlayer.hidden_norm.weight": "midlayer.input_layernorm.weight",
    }),
    signature=frozenset({"embnorm.weight"}),
    translate_config=_specforge_config,
    describe="a SpecForge EdsdDraftModel checkpoint",
)
EDSD_VLLM = Layout(
    name="edsd-vllm",
    # vLLM prefixes ``Eagle3`` to every eagle3 draft architecture (configs/eagle.py).
    architectures=("EDSDLlamaForCausalLM", "Eagle3EDSDLlamaForCausalLM"),
    names=NameMap({
        "edfuse.feature_gate.weight": "edfuse.gate_proj.weight",
        "edfuse.token_up.weight": "edfuse.up_proj.weight",
        "edfuse.fuse_down.weight": "edfuse.down_proj.weight",
    }),
    signature=frozenset({"edfuse.feature_gate.weight"}),
    write_config=EDSDConfig.to_vllm_dict,
    describe="an EDSD drafter in the vLLM layout",
)
EAGLE3 = Layout(
    name="eagle3",
    architectures=("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM"),
    names=NameMap(),
    signature=frozenset(),
    translate_config=_not_edsd,
    describe="an EAGLE-3 drafter",
)
LAYOUTS = (EDSD_TRAINING, SPECFORGE_EDSD, EDSD_VLLM, EAGLE3)


def detect_layout(raw: dict, tensor_names: Iterable[str], *, source: str) -> Layout:
    """The layout of a drafter, by its architecture name, else by its tensor names."""
    archs = raw.get("architectures") or []
    for layout in LAYOUTS:
        if any(a in layout.architectures for a in archs):
            return layout
    names = set(tensor_names)
    for layout in LAYOUTS:
        if layout.signature and layout.signature <= names:
            return layout
    if "midlayer.hidden_norm.weight" in names and not any(n.startswith("edfuse.") for n in names):
        return EAGLE3
    known = ", ".join(a for layout in LAYOUTS for a in layout.architectures)
    raise EDSDError(
        f"{source}: not an EDSD drafter: architectures={archs} and no EDFuse tensors "
        f"(edfuse.*, embnorm.weight); known architectures: {known}"
    )


def read_drafter_config(path: str | Path, tensor_names: Iterable[str] = ()) -> tuple[Layout, EDSDConfig]:
    """Layout and validated config of a drafter directory."""
    raw = read_config_json(path)
    source = f"{path}/config.json"
    layout = detect_layout(raw, tensor_names, source=source)
    return layout, layout.read_config(raw, source=source)


def read_eagle3_config(path: str | Path) -> tuple[EDSDConfig, tuple[int, int, int]]:
    """An EAGLE-3 drafter directory's draft layer (as an ``EDSDConfig``, whose EDSD-only fields
    it does not use) and its three aux layer ids (vLLM's convention), from the config.json
    vLLM's ``"method": "eagle3"`` reads."""
    raw = read_config_json(path)
    source = f"{path}/config.json"
    if not set(raw.get("architectures") or []) & set(EAGLE3.architectures):
        raise EDSDError(f"{source}: not an EAGLE-3 drafter (architectures={raw.get('architectures')}; "
                        f"expected one of {', '.join(EAGLE3.architectures)})")
    ids = raw.get("eagle_aux_hidden_state_layer_ids") or (raw.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    if not isinstance(ids, list) or len(set(ids)) != 3 or not all(is_int(i) and i >= 0 for i in ids):
        raise EDSDError(f"{source}: field 'eagle_aux_hidden_state_layer_ids' must list three distinct non-negative "
                        f"target layer ids, got {ids!r:.80}")
    # EDSDConfig holds two aux layers, as `edsd train --method eagle3` builds it; the model keeps all three.
    edsd = {"aux_layer_ids": sorted(ids)[:2], "aux_layer_id_convention": LAYER_INPUT,
            "fuse_intermediate_size": raw.get("intermediate_size"), "token_norm": RMSNORM}
    return EDSDConfig.from_dict({**raw, "edsd_config": edsd}, source=source), tuple(sorted(ids))


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
