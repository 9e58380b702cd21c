"""A drafter directory copied with edits, and the speculative config that serves a drafter, checked by
vLLM's own config path."""

from __future__ import annotations

import atexit
import functools
import json
import shutil
import tempfile
from pathlib import Path

# EDSD with the paper's draft layer, trained for the demo target on 10,043 conversations (the demo's
# drafter until the token-reading one shipped), vLLM's layout: the paper's design on real weights,
# whose fed-back state leaves float16's range (tests of float16 and of SpecForge's layout). Stored
# small: every matrix as int8 with a float32 scale per row (its largest |value| / 127, named
# ``NAME.row_scale``), every other tensor as it was saved.
PAPER_LAYER_EDSD_STORED = Path(__file__).parents[1] / "assets" / "edsd-paper-layer-10k"
ROW_SCALE = ".row_scale"


@functools.cache
def paper_layer_edsd() -> Path:
    """The stored paper's-layer drafter as a float16 drafter directory (``model.safetensors``), made
    once per process in a temporary directory removed at exit."""
    import torch
    from safetensors.torch import load_file, save_file

    stored = load_file(PAPER_LAYER_EDSD_STORED / "model.int8.safetensors")
    tensors = {name: (t.float() * stored[name + ROW_SCALE][:, None]).to(torch.float16) if name + ROW_SCALE in stored
               else t for name, t in stored.items() if not name.endswith(ROW_SCALE)}
    root = Path(tempfile.mkdtemp(prefix="edsd-paper-layer-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    shutil.copy(PAPER_LAYER_EDSD_STORED / "config.json", root / "config.json")
    save_file(tensors, root / "model.safetensors", metadata={"format": "pt"})
    return root


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
