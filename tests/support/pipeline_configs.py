"""Pipeline configs and runs for the pipeline's tests: a TOML file from sections, and what a finished
run leaves (its final tensors and logged losses), compared exactly."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from vllm_edsd.checkpoint.files import finished_checkpoint


def toml_value(value) -> str:
    if isinstance(value, dict):  # an inline table
        return "{" + ", ".join(f"{key} = {toml_value(v)}" for key, v in value.items()) + "}"
    return json.dumps(value)  # strings, numbers, booleans and lists of them read the same in TOML


def write_config(path: Path, sections: dict[str, dict]) -> Path:
    """The sections as TOML; a key set to None is left out."""
    path.write_text("".join(f"[{section}]\n" + "".join(f"{key} = {toml_value(v)}\n" for key, v in values.items()
                                                       if v is not None)
                            for section, values in sections.items()))
    return path


def run_results(work: Path) -> dict:
    """Every final tensor and every logged loss of a finished pipeline."""
    out = {}
    for checkpoint in ("edsd/final", "eagle3/final", "edsd-vllm"):
        assert finished_checkpoint(work / checkpoint), checkpoint
        out[checkpoint] = load_file(work / checkpoint / "model.safetensors")
    for method in ("edsd", "eagle3"):
        log = [json.loads(line) for line in (work / method / "train_log.jsonl").read_text().splitlines()]
        out[f"{method} losses"] = [(e["epoch"], e["loss"], e["acc_per_step"]) for e in log]
    return out


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], dict):
            assert a[key].keys() == b[key].keys() and all(torch.equal(a[key][t], b[key][t]) for t in a[key]), key
        else:
            assert a[key] == b[key], key
