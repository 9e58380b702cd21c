"""A drafter directory copied with edits, and the speculative config that serves a drafter, checked by
vLLM's own config path."""

from __future__ import annotations

import json
from pathlib import Path

# EDSD with the paper's draft layer, trained for the demo target on 10,043 conversations (the demo's
# drafter until the token-reading one shipped), float16, vLLM's layout: the paper's design on real
# weights, whose fed-back state leaves float16's range (tests of float16 and of SpecForge's layout).
PAPER_LAYER_EDSD = Path(__file__).parents[1] / "assets" / "edsd-paper-layer-10k"


def speculative_spec(method: str, drafter, k: int = 4, **extra) -> dict:
    """The speculative config that serves ``drafter`` with ``method`` ("edsd", vLLM's "eagle3")."""
    return {"method": method, "model": str(drafter), "num_speculative_tokens": k, **extra}


def edsd_spec(drafter, k: int = 4, **extra) -> dict:
    return speculative_spec("edsd", drafter, k, **extra)


def engine_config(target: str, spec: dict):
    """vLLM's own config path for a speculative config (no engine is started)."""
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=target, speculative_config=spec, gpu_memory_utilization=0.25).create_engine_config()


def edited_copy(src, dst: Path, edit_config=None, edit_tensors=None) -> Path:
    """A copy of a drafter directory with its config.json and/or tensors edited in place."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    if edit_config:
        cfg = json.loads((dst / "config.json").read_text())
        edit_config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    if edit_tensors:
        tensors = load_file(dst / "model.safetensors")
        edit_tensors(tensors)
        save_file(tensors, dst / "model.safetensors")
    return dst
