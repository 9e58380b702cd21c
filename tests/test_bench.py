"""``python -m bench all --quick`` on toy models: every suite runs, and the report is
consistent with results.json. Benchmarks are not tests: no timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from bench.latency import NOT_COMPLETED, aggregate, poisson_schedule, summary
from bench.offline import with_speedup
from bench.report import render


@pytest.fixture(scope="module")
def bench_run(models, tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    out = root / "out"
    # The training-free baseline and EDSD; eagle3 is served by the same code path as edsd (vLLM's
    # EAGLE-3 machinery) and is left out to keep CI's engine count.
    cmd = [sys.executable, "-m", "bench", "all", "--quick", "--out", str(out), "--target", models["llama"],
           "--edsd", models["llama-edsd"], "--methods", "none,ngram,edsd"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def test_all_suites_and_methods_present(bench_run):
    results = json.loads((bench_run / "results.json").read_text())
    runs = results["runs"]
    assert results["failed_suites"] == {}
    assert {r["suite"] for r in runs} == {"acceptance", "throughput", "latency", "robustness"}
    for suite in ("acceptance", "throughput", "latency"):
        assert {r["method"] for r in runs if r["suite"] == suite} == {"none", "ngram", "edsd"}
    assert {r["system_prompt"] for r in runs if r["suite"] == "robustness"} == {
        "default",
        *(f"system-{i}" for i in range(10)),
    }
    assert {r["category"] for r in runs if r["suite"] == "acceptance"} == {
        "chat",
        "code",
        "math",
        "instruction",
        "summarization",
    }
    assert set(results["machine"]) >= {"processor", "cores", "vllm", "torch", "vllm_edsd"}


def test_speedups_are_ratios_within_the_run(bench_run):
    runs = json.loads((bench_run / "results.json").read_text())["runs"]
    for r in (r for r in runs if r["suite"] == "throughput"):
        base = next(b for b in runs if b["suite"] == "throughput" and b["method"] == "none"
                    and b["batch_size"] == r["batch_size"] and b["temperature"] == r["temperature"])
        assert r["speedup"] == pytest.approx(r["output_tokens_per_s"] / base["output_tokens_per_s"])
    for r in (r for r in runs if r["suite"] == "acceptance" and r["method"] != "none"):
        assert r["tau"] is not None and len(r["acceptance_per_pos"]) == r["k"]


def test_latency_rows_from_raw_timings(bench_run):
    runs = json.loads((bench_run / "results.json").read_text())["runs"]
    lat = [r for r in runs if r["suite"] == "latency"]
    assert {r["num_requests"] for r in lat} == {16}  # --quick: the same 16 scheduled arrivals for every method
    for r in lat:
        assert r["failures"] == 0 and r["failure_reasons"] == {}, r["failure_reasons"]
        assert r["output_tokens"] == r["num_requests"] * 24  # from the server's usage; ignore_eos, --quick max_tokens
        assert r["achieved_qps"] > 0 and r["output_tokens_per_s"] > 0 and r["late_starts"] >= 0
        for name in ("e2e", "ttft", "itl"):
            assert 0 < r[f"{name}_p50_s"] <= r[f"{name}_p99_s"]
            assert r[f"{name}_mean_s"] > 0
        assert r["ttft_p99_s"] <= r["e2e_p99_s"] and r["ttft_mean_s"] <= r["e2e_mean_s"]
        assert r["itl_mean_s"] <= r["e2e_mean_s"]


def test_report_and_plots(bench_run):
    results = json.loads((bench_run / "results.json").read_text())
    report = (bench_run / "report.md").read_text()
    assert report == render(results)
    for heading in ("Acceptance", "Throughput", "Latency", "Robustness"):
        assert f"## {heading}" in report
    for png in ("acceptance_per_position.png", "speedup_vs_batch.png", "latency_vs_rate.png"):
        assert (bench_run / png).stat().st_size > 1000


def test_draft_length_variants_side_by_side(models, tmp_path):
    """The throughput suite serves the EDSD drafter statically, with the adaptive draft length
    and with vLLM's batch-size table, at T=0 and T=1, and reports the draft length each used:
    K for static drafts; K at batch 1 and about K/2 at batch 8 under the table; fewer tokens than
    static under the adaptive rule (this drafter has random weights: its drafts are unsure)."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "bench", "throughput", "--quick", "--out", str(out), "--target", models["llama"],
           "--edsd", models["llama-edsd"], "--methods", "none,edsd,edsd-adaptive,edsd-batch-table",
           "--temperatures", "0,1", "--batch-sizes", "1,8"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads((out / "results.json").read_text())
    rows = {(r["method"], r["batch_size"], r["temperature"]): r for r in results["runs"]}
    assert set(rows) == {(m, b, t) for m in ("none", "edsd", "edsd-adaptive", "edsd-batch-table")
                         for b in (1, 8) for t in (0.0, 1.0)}
    for t in (0.0, 1.0):
        assert rows["edsd", 1, t]["mean_draft_length"] == rows["edsd", 8, t]["mean_draft_length"] == 4
        assert rows["edsd-batch-table", 1, t]["mean_draft_length"] == 4
        # Mostly K/2: steps while fewer than 5 of the 8 requests are scheduled draft K.
        assert rows["edsd-batch-table", 8, t]["mean_draft_length"] < 3
        for b in (1, 8):
            assert rows["edsd-adaptive", b, t]["draft_tokens"] < rows["edsd", b, t]["draft_tokens"]
    assert "| edsd-adaptive | 4 | 1 | 8 |" in (out / "report.md").read_text()


def test_unknown_bench_method_is_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "bench", "throughput", "--out", str(tmp_path / "out"),
                           "--methods", "none,edsd-fancy"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "unknown method(s) edsd-fancy" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_speedup_helper():
    rows = [{"method": "none", "batch_size": 1, "output_tokens_per_s": 10.0},
            {"method": "edsd", "batch_size": 1, "output_tokens_per_s": 15.0},
            {"method": "edsd", "batch_size": 2, "output_tokens_per_s": 15.0}]
    assert [r["speedup"] for r in with_speedup(rows, ("batch_size",))] == [1.0, 1.5, None]


def test_poisson_schedule_is_seeded_and_has_exponential_gaps():
    arrivals = poisson_schedule(4.0, 20000, seed=1)
    assert arrivals == poisson_schedule(4.0, 20000, seed=1)
    assert arrivals[:10] != poisson_schedule(4.0, 10, seed=2)
    gaps = np.diff([0.0, *arrivals])
    assert (gaps > 0).all()
    assert gaps.mean() == pytest.approx(1 / 4.0, rel=0.03)
    assert gaps.std() == pytest.approx(gaps.mean(), rel=0.05)  # exponential: sd = mean (constant gaps: sd 0)
    assert np.median(gaps) == pytest.approx(np.log(2) / 4.0, rel=0.05)


def test_summary_is_computed_from_raw_values():
    values = [float(v) for v in range(1, 101)]
    assert summary(values, "e2e") == {"e2e_mean_s": 50.5, "e2e_p50_s": 50.5, "e2e_p99_s": pytest.approx(99.01)}
    assert summary([], "ttft") == {"ttft_mean_s": None, "ttft_p50_s": None, "ttft_p99_s": None}


def test_aggregate_counts_failures_and_derives_ttft_itl():
    def record(start, e2e, chunks, tokens, error=None, late=0.0):
        return {"scheduled_s": start - late, "start_s": start, "e2e_s": e2e, "chunks": chunks, "output_tokens": tokens,
                "error": error}

    records = [record(0.0, 1.0, [[0.2, 1], [0.6, 2], [1.0, 2]], 5),  # ttft 0.2, itl (1.0 - 0.2) / 4
               record(1.0, 2.0, [[0.5, 1], [1.5, 1]], 2, late=0.2),  # ttft 0.5, itl 1.0
               record(2.0, 0.1, [], 0, error="HTTP 500"),
               record(3.0, 0.4, [[0.3, 1]], 0, error="truncated stream (no [DONE])")]
    row = aggregate(records, scheduled=5)
    assert row["num_requests"] == 5 and row["failures"] == 3
    assert row["failure_reasons"] == {"HTTP 500": 1, "truncated stream (no [DONE])": 1, NOT_COMPLETED: 1}
    assert row["late_starts"] == 1
    assert row["achieved_qps"] == pytest.approx(3 / 3.0)
    assert row["output_tokens"] == 7 and row["output_tokens_per_s"] == pytest.approx(7 / 3.0)
    assert row["ttft_mean_s"] == pytest.approx(0.35) and row["e2e_mean_s"] == pytest.approx(1.5)
    assert row["itl_p50_s"] == pytest.approx((0.2 + 1.0) / 2)


@pytest.mark.parametrize(("suite", "absent", "package"), [("acceptance", "matplotlib", "matplotlib"),
                                                           ("latency", "locust", "locust")])
def test_missing_optional_dependency_is_one_line_before_any_work(tmp_path, suite, absent, package):
    """Without the bench extra, `python -m bench` names what to install and exits 2 before it
    measures anything (no traceback, no output directory)."""
    out = tmp_path / "results"
    code = (f"import sys; sys.modules[{absent!r}] = None\n"  # what an environment without it looks like
            f"from bench.__main__ import main; sys.exit(main([{suite!r}, '--out', {str(out)!r}, '--quick']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"missing {package}" in proc.stderr and "pip install 'vllm-edsd[bench]'" in proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()
