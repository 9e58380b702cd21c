"""``python -m bench all --quick`` on toy models: every suite runs, and the report is
consistent with results.json. Benchmarks are not tests: no timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from bench.offline import with_speedup
from bench.report import render
from vllm_edsd.config import EDSDConfig
from vllm_edsd.toy import target_config
from vllm_edsd.training.eagle3 import Eagle3DraftModel


@pytest.fixture(scope="module")
def bench_run(models, tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    cfg = EDSDConfig.for_target(target_config(models["llama"]), (1, 3), draft_vocab_size=512)
    torch.manual_seed(0)
    Eagle3DraftModel(cfg, (1, 2, 3)).save_pretrained(root / "eagle3")
    out = root / "out"
    cmd = [sys.executable, "-m", "bench", "all", "--quick", "--out", str(out), "--target", models["llama"],
           "--edsd", models["llama-edsd"], "--eagle3", str(root / "eagle3")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def test_all_suites_and_methods_present(bench_run):
    results = json.loads((bench_run / "results.json").read_text())
    runs = results["runs"]
    assert {r["suite"] for r in runs} == {"acceptance", "throughput", "latency", "robustness"}
    for suite in ("acceptance", "throughput", "latency"):
        assert {r["method"] for r in runs if r["suite"] == suite} == {"none", "eagle3", "edsd"}
    assert {r["system_prompt"] for r in runs if r["suite"] == "robustness"} == {"default", *(f"system-{i}" for i in range(10))}
    assert {r["category"] for r in runs if r["suite"] == "acceptance"} == {"chat", "code", "math", "instruction", "summarization"}
    assert all(r["failures"] == 0 and r["num_requests"] > 0 for r in runs if r["suite"] == "latency")
    assert set(results["machine"]) >= {"processor", "cores", "vllm", "torch", "vllm_edsd"}


def test_speedups_are_ratios_within_the_run(bench_run):
    runs = json.loads((bench_run / "results.json").read_text())["runs"]
    for r in (r for r in runs if r["suite"] == "throughput"):
        base = next(b for b in runs if b["suite"] == "throughput" and b["method"] == "none" and b["batch_size"] == r["batch_size"])
        assert r["speedup"] == pytest.approx(r["output_tokens_per_s"] / base["output_tokens_per_s"])
    for r in (r for r in runs if r["suite"] == "acceptance" and r["method"] != "none"):
        assert r["tau"] is not None and len(r["acceptance_per_pos"]) == r["k"]


def test_report_and_plots(bench_run):
    results = json.loads((bench_run / "results.json").read_text())
    report = (bench_run / "report.md").read_text()
    assert report == render(results)
    for heading in ("Acceptance", "Throughput", "Latency", "Robustness"):
        assert f"## {heading}" in report
    for png in ("acceptance_per_position.png", "speedup_vs_batch.png", "latency_vs_rate.png"):
        assert (bench_run / png).stat().st_size > 1000


def test_speedup_helper():
    rows = [{"method": "none", "batch_size": 1, "output_tokens_per_s": 10.0},
            {"method": "edsd", "batch_size": 1, "output_tokens_per_s": 15.0},
            {"method": "edsd", "batch_size": 2, "output_tokens_per_s": 15.0}]
    assert [r["speedup"] for r in with_speedup(rows, ("batch_size",))] == [1.0, 1.5, None]
