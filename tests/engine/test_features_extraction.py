"""Target features through vLLM's hidden-state extraction (``edsd features``, the default where
the installed vLLM has it): equal to the transformers path's on the demo target for the layers
EDSelect chose, and read by ``edsd train`` without another target forward."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vllm_edsd.demo import ASSETS, DEMO_PROMPTS
from vllm_edsd.demo.target import demo_target
from vllm_edsd.features.shards import read_shard

# Both paths run the target in float32 and store bfloat16: the float32 states differ by ~2e-6
# relative (measured), so a stored value may round to the neighbouring bfloat16 (2^-8 relative).
BF16_STEP = 2.0**-7
ARGMAX_AGREEMENT = 0.99  # a near-tie between two tokens may go either way


def edsd(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "vllm_edsd", *args], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def stored(cache: Path) -> dict[tuple[int, ...], dict]:
    """Every cached record, by its tokens."""
    records = [r for shard in sorted((cache / "features").glob("shard-*.safetensors")) for r in read_shard(shard)]
    return {tuple(r["input_ids"].tolist()): r for r in records}


@pytest.fixture(scope="module")
def extracted(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("features")
    data = root / "chat.jsonl"
    answers = [prompt for _, prompt in DEMO_PROMPTS[1:]] + [DEMO_PROMPTS[0][1]]
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": prompt},
                                                     {"role": "assistant", "content": answer}]}) + "\n"
                            for (_, prompt), answer in zip(DEMO_PROMPTS, answers)))
    layers = ",".join(map(str, json.loads((ASSETS / "layers.json").read_text())["aux_layer_ids"]))
    target = str(demo_target())
    common = ["--data", str(data), "--feature-layers", layers, "--max-length", "256", "--device", "cpu"]
    out = {"target": target, "data": data, "layers": layers, "common": common, "root": root}
    out["vllm_log"] = edsd("features", target, "--cache", str(root / "vllm"), *common)  # the default backend
    edsd("features", target, "--cache", str(root / "transformers"), "--features-backend", "transformers", *common)
    return out


def test_vllm_is_the_default_and_reports_its_speed(extracted):
    assert "target features (vllm):" in extracted["vllm_log"] and "positions/s" in extracted["vllm_log"]
    assert f"{len(DEMO_PROMPTS)} samples" in extracted["vllm_log"]


def test_vllm_features_equal_the_transformers_ones(extracted):
    by_vllm, by_transformers = stored(extracted["root"] / "vllm"), stored(extracted["root"] / "transformers")
    assert by_vllm.keys() == by_transformers.keys() and len(by_vllm) == len(DEMO_PROMPTS)
    agree = total = 0
    for tokens, ours in by_vllm.items():
        theirs = by_transformers[tokens]
        assert torch.equal(ours["loss_mask"], theirs["loss_mask"])
        for key in ("aux", "final"):
            a, b = ours[key].float(), theirs[key].float()
            assert a.shape == b.shape
            assert torch.allclose(a, b, rtol=BF16_STEP, atol=BF16_STEP * float(b.abs().mean())), key
        assert torch.allclose(ours["target_entropy"], theirs["target_entropy"], rtol=1e-3, atol=1e-3)
        agree += int((ours["target_argmax"] == theirs["target_argmax"]).sum())
        total += len(tokens)
    assert agree / total >= ARGMAX_AGREEMENT


def test_train_reads_the_extracted_features_without_a_target_forward(extracted, tmp_path):
    log = edsd("train", extracted["target"], "--out", str(tmp_path / "run"), "--cache",
               str(extracted["root"] / "vllm"), "--layers", extracted["layers"], "--epochs", "1",
               "--ttt-steps", "2", "--draft-vocab-size", "512", *extracted["common"][:2], *extracted["common"][4:])
    assert "positions/s" not in log  # no shard was missing
    assert (tmp_path / "run" / "final" / "config.json").is_file()
