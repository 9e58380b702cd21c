"""The layout of EAGLE-3 drafters: the names vLLM's own EAGLE-3 method loads (SpecForge's)."""

from __future__ import annotations

from pathlib import Path

from vllm_edsd.checkpoint.layouts import Layout, NameMap
from vllm_edsd.checkpoint.target import read_config_json
from vllm_edsd.errors import EDSDError, is_int
from vllm_edsd.methods.eagle3.config import Eagle3Config


def _has_eagle3_tensors(names: set[str]) -> bool:
    """EAGLE-3's draft layer norms its feature input (``hidden_norm``) and has no EDFuse."""
    return "midlayer.hidden_norm.weight" in names and not any(n.startswith("edfuse.") for n in names)


def _not_edsd(raw: dict, source: str) -> dict:
    raise EDSDError(
        f"{source}: this is an EAGLE-3 drafter (architectures={raw.get('architectures')}), not EDSD; "
        "serve it with vLLM's own \"method\": \"eagle3\""
    )


EAGLE3_LAYOUT = Layout(
    name="eagle3-vllm",
    architectures=("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM"),
    names=NameMap(),
    signature=frozenset(),
    recognise=_has_eagle3_tensors,
    translate_config=_not_edsd,
    describe="an EAGLE-3 drafter",
)


def read_eagle3_config(path: str | Path) -> tuple[Eagle3Config, tuple[int, int, int]]:
    """An EAGLE-3 drafter directory's draft layer, its EAGLE 3.1 switches and its three aux
    layer ids (vLLM's convention), from the config.json vLLM's ``"method": "eagle3"`` reads."""
    raw = read_config_json(path)
    source = f"{path}/config.json"
    if not set(raw.get("architectures") or []) & set(EAGLE3_LAYOUT.architectures):
        raise EDSDError(f"{source}: not an EAGLE-3 drafter (architectures={raw.get('architectures')}; "
                        f"expected one of {', '.join(EAGLE3_LAYOUT.architectures)})")
    ids = raw.get("eagle_aux_hidden_state_layer_ids") or (raw.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    if not isinstance(ids, list) or len(set(ids)) != 3 or not all(is_int(i) and i >= 0 for i in ids):
        raise EDSDError(f"{source}: field 'eagle_aux_hidden_state_layer_ids' must list three distinct non-negative "
                        f"target layer ids, got {ids!r:.80}")
    return Eagle3Config.from_dict(raw, source=source), tuple(sorted(ids))
