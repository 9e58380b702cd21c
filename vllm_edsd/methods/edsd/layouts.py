"""The layouts EDSD drafters come in (``checkpoint/layouts.py`` says what a layout is).

* ``EDSD_TRAINING`` — what ``edsd train`` writes (docs/formats.md): canonical names, ``edsd_config``.
* ``SPECFORGE_EDSD`` — SpecForge's ``EdsdDraftModel`` (the paper's training code): a plain
  Llama config with ``target_layer_ids`` in the "output of layer i" convention, the EDFuse
  width in ``intermediate_size``, an RMSNorm ``embnorm`` and ``midlayer.hidden_norm``.
* ``EDSD_VLLM`` — what the plugin serves (docs/formats.md); EDFuse's projections are renamed so
  vLLM's stacked gate/up loaders do not catch them.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from vllm_edsd.checkpoint.layouts import Layout, NameMap, detect_layout
from vllm_edsd.checkpoint.target import LAYER_OUTPUT, read_config_json
from vllm_edsd.errors import EDSDError, is_int
from vllm_edsd.methods.eagle3.layouts import EAGLE3_LAYOUT
from vllm_edsd.methods.edsd.config import RMSNORM, EDSDConfig


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


EDSD_TRAINING = Layout(
    name="edsd-training",
    architectures=("LlamaForCausalLMEDSD",),
    names=NameMap(),
    signature=frozenset({"edfuse.gate_proj.weight"}),
    config=EDSDConfig,
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
    config=EDSDConfig,
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
    config=EDSDConfig,
    write_config=EDSDConfig.to_vllm_dict,
    describe="an EDSD drafter in the vLLM layout",
)
LAYOUTS = (EDSD_TRAINING, SPECFORGE_EDSD, EDSD_VLLM)


def read_edsd_config(path: str | Path, tensor_names: Iterable[str] = ()) -> tuple[Layout, EDSDConfig]:
    """Layout and validated config of an EDSD drafter directory; an EAGLE-3 one is refused by name."""
    raw = read_config_json(path)
    source = f"{path}/config.json"
    layout = detect_layout(raw, tensor_names, (*LAYOUTS, EAGLE3_LAYOUT), source=source)
    return layout, layout.read_config(raw, source=source)
