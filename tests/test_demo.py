"""The shipped demo pair: `edsd demo --paths`, the artifacts themselves, and real vLLM serving
them losslessly with trained drafters (held-out chat and code prompts)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from bench.offline import load_prompts
from conftest import greedy_phase
from vllm_edsd.formats.files import tensor_shapes
from vllm_edsd.formats.config import TargetFingerprint
from vllm_edsd.data import render_conversation
from vllm_edsd.demo import ASSETS
from vllm_edsd.target import fingerprint, load_target

K = 4
SHIPPED_BUDGET_BYTES = 60 * 2**20


@pytest.fixture(scope="module")
def paths() -> dict[str, str]:
    out = subprocess.run([sys.executable, "-m", "vllm_edsd.cli", "demo", "--paths"], capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout)


def test_paths_are_absolute_model_directories(paths):
    assert set(paths) == {"target", "edsd", "eagle3"}
    for path in paths.values():
        assert Path(path).is_absolute() and (Path(path) / "config.json").is_file()


def test_shipped_artifacts_fit_the_budget_and_the_target(paths):
    shipped = sum(f.stat().st_size for f in ASSETS.rglob("*") if f.is_file())
    assert shipped <= SHIPPED_BUDGET_BYTES, f"{shipped / 2**20:.1f} MB shipped"
    target = load_target(paths["target"])
    recorded = json.loads((Path(paths["edsd"]) / "config.json").read_text())["edsd_config"]["target"]
    assert TargetFingerprint.from_dict(recorded) == fingerprint(target)
    for drafter in ("edsd", "eagle3"):
        config = json.loads((Path(paths[drafter]) / "config.json").read_text())
        assert config["torch_dtype"] == "float16"
        assert config["vocab_size"] == target.config.vocab_size
        assert all(len(shape) for shape in tensor_shapes(paths[drafter]).values())


@pytest.fixture(scope="module")
def held_out_prompts(paths) -> list[list[int]]:
    """Chat prompts written for the bench and HumanEval prompts: neither is training data."""
    tokenizer = AutoTokenizer.from_pretrained(paths["target"])
    messages = load_prompts("chat", 3) + load_prompts("code", 3)
    return [render_conversation(tokenizer, m, generation_prompt=True)[0] for m in messages]


def serve(paths, engine_runs, method: str | None, prompts) -> dict:
    spec = None if method is None else {"method": method, "model": paths[method], "num_speculative_tokens": K}
    job = {"target": paths["target"], "speculative_config": spec,
           "llm_kwargs": {"enforce_eager": True, "dtype": "float32"},
           "phases": [greedy_phase(prompts=prompts, max_tokens=64)]}
    return engine_runs(f"demo-{method}", job)["phases"]["greedy"]


@pytest.mark.parametrize("method", ["edsd", "eagle3"])
def test_shipped_drafters_serve_losslessly_with_real_acceptance(paths, engine_runs, held_out_prompts, method):
    plain = serve(paths, engine_runs, None, held_out_prompts)
    run = serve(paths, engine_runs, method, held_out_prompts)
    assert run["outputs"] == plain["outputs"]
    print(method, "tau", run["counters"]["tau"])
    # An untrained drafter, or wrong aux layers, stays near 1.0 (SPEC §3.1).
    assert run["counters"]["tau"] > 1.5
