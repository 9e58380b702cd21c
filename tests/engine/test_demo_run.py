"""The shipped demo pair: `edsd demo --paths`, the drafters themselves, and real vLLM serving
them losslessly at the acceptance recorded when they were shipped (held-out chat and code prompts)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.engine_runs import greedy_phase

from vllm_edsd.checkpoint.files import tensor_shapes
from vllm_edsd.checkpoint.target import TargetFingerprint
from vllm_edsd.demo import ACCEPTANCE_CHECK, ASSETS, DEMO_PROMPTS, check_prompt_ids
from vllm_edsd.features.hidden_states import fingerprint
from vllm_edsd.launch.transformers_target import load_target

SHIPPED_BUDGET_BYTES = 50 * 10**6  # both drafters together, fp16


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
    assert shipped <= SHIPPED_BUDGET_BYTES, f"{shipped / 1e6:.1f} MB shipped"
    target = load_target(paths["target"])
    recorded = json.loads((Path(paths["edsd"]) / "config.json").read_text())["edsd_config"]["target"]
    assert TargetFingerprint.from_dict(recorded) == fingerprint(target)
    for drafter in ("edsd", "eagle3"):
        config = json.loads((Path(paths[drafter]) / "config.json").read_text())
        assert config["torch_dtype"] == "float16"
        assert config["vocab_size"] == target.config.vocab_size
        assert all(len(shape) for shape in tensor_shapes(paths[drafter]).values())


TAU_TOLERANCE = 0.15  # fp32 kernels differ across CPUs (AVX2 / AVX-512) and can flip a near-tie


@pytest.fixture(scope="module")
def recorded() -> dict:
    return json.loads((ASSETS / "acceptance.json").read_text())


def serve(paths, engine_runs, method: str | None) -> dict:
    spec = None if method is None else {"method": method, "model": paths[method],
                                        "num_speculative_tokens": ACCEPTANCE_CHECK["k"]}
    job = {"target": paths["target"], "speculative_config": spec, "llm_kwargs": ACCEPTANCE_CHECK["llm_kwargs"],
           "phases": [greedy_phase(prompts=check_prompt_ids(paths["target"]),
                                   max_tokens=ACCEPTANCE_CHECK["max_tokens"])]}
    return engine_runs(f"demo-{method}", job)["phases"]["greedy"]


def test_demo_prompts_are_in_no_training_data():
    from vllm_edsd.demo.build import PIPELINE
    from vllm_edsd.pipeline.config import read_toml
    from vllm_edsd.pipeline.conversations import drafter_prompts

    data = read_toml(PIPELINE)["data"]  # tomllib, or tomli on Python 3.10
    trained = {m[0]["content"] for m in drafter_prompts(data["sharegpt_chat"], data["sharegpt_code"], data["seed"])}
    assert not trained & {prompt for _, prompt in DEMO_PROMPTS}


def test_target_answers_in_english(paths, engine_runs):
    """The demo target is a real chat model: its greedy answer to the hash-table prompt is about hash tables."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(paths["target"])
    index = [prompt for _, prompt in DEMO_PROMPTS].index("Explain what a hash table is to a beginner.")
    text = tokenizer.decode(serve(paths, engine_runs, None)["outputs"][index])
    assert "hash table" in text.lower() and "data" in text.lower(), text


@pytest.mark.parametrize("method", ["edsd", "eagle3"])
def test_shipped_drafters_serve_losslessly_at_their_recorded_acceptance(paths, engine_runs, recorded, method):
    assert recorded["settings"] == ACCEPTANCE_CHECK
    plain = serve(paths, engine_runs, None)
    run = serve(paths, engine_runs, method)
    assert run["outputs"] == plain["outputs"]
    tau = run["counters"]["tau"]
    assert abs(tau - recorded[method]["tau"]) <= TAU_TOLERANCE, f"tau {tau:.3f}, recorded {recorded[method]['tau']:.3f}"
