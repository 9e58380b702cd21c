"""``python -m bench all --quick`` on toy models: every suite runs, and the report's rows
carry results.json's values. Benchmarks are not tests: no timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from support.engine_runs import in_process_core
from support.report_tables import mismatches

# The engine core in the bench's process: two vLLM imports less per engine (its core's and its
# worker's). `bench all` takes EDSD's engine first: the third of the process, after the prompt
# lookup's, it failed to start so (docs/known-issues.md).
IN_PROCESS = in_process_core()


@pytest.fixture(scope="module")
def bench_run(models, tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    out = root / "out"
    # The training-free baseline and EDSD; eagle3 is served by the same code path as edsd (vLLM's
    # EAGLE-3 machinery) and is left out to keep CI's engine count.
    cmd = [sys.executable, "-m", "bench", "all", "--quick", "--out", str(out), "--target", models["llama"],
           "--edsd", models["llama-edsd"], "--methods", "edsd,none,ngram",  # EDSD first: see IN_PROCESS
           "--qps", "4"]  # the latency suite's 16 arrivals in about 4 s a server, not 16
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=IN_PROCESS)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def test_all_suites_and_methods_present(bench_run):
    results = json.loads((bench_run / "results.json").read_text())
    runs = results["runs"]
    assert results["failed_suites"] == {}
    assert {r["suite"] for r in runs} == {"acceptance", "throughput", "latency", "robustness", "mixed"}
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
    assert results["config"]["eager"] is True  # --quick's engines and servers skip torch.compile
    assert "engines eager (no torch.compile)" in (bench_run / "report.md").read_text()


def test_speedups_are_ratios_within_the_run(bench_run):
    runs = json.loads((bench_run / "results.json").read_text())["runs"]
    for r in (r for r in runs if r["suite"] == "throughput"):
        base = next(b for b in runs if b["suite"] == "throughput" and b["method"] == "none"
                    and b["batch_size"] == r["batch_size"] and b["temperature"] == r["temperature"])
        assert r["speedup"] == pytest.approx(r["output_tokens_per_s"] / base["output_tokens_per_s"])
    for r in (r for r in runs if r["suite"] == "acceptance" and r["method"] != "none"):
        if r["method"] == "ngram" and not r["draft_tokens"]:
            continue  # prompt lookup found no n-gram to propose in the toy target's output: no τ
        assert r["tau"] is not None and len(r["acceptance_per_pos"]) == r["k"]
    assert any(r["tau"] for r in runs if r["suite"] == "acceptance" and r["method"] == "edsd")


def test_mixed_batch_halves_against_all_k_and_all_off(bench_run):
    """Per drafting method: the batch served all at K, all opted out and half opted out, each
    half with its own tok/s; nothing is drafted when all opt out, something when half do."""
    runs = [r for r in json.loads((bench_run / "results.json").read_text())["runs"] if r["suite"] == "mixed"]
    assert {r["method"] for r in runs} == {"ngram", "edsd"}
    for method in ("ngram", "edsd"):
        rows = {(r["run"], r["half"]): r for r in runs if r["method"] == method}
        assert set(rows) == {(run, half) for run in ("all-K", "all-off", "half-off") for half in ("even", "odd")}
        for r in rows.values():
            assert r["output_tokens"] == 2 * 24 and r["output_tokens_per_s"] > 0  # --quick: batch 4, 24 tokens
        assert rows["all-off", "even"]["tau"] is None
        assert rows["half-off", "even"]["drafting"] and not rows["half-off", "odd"]["drafting"]
    assert next(r for r in runs if r["method"] == "edsd" and r["run"] == "half-off")["tau"] is not None


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
    """Every run of results.json is its row of report.md, in order, with its numbers (read back
    from the markdown, within the report's rounding)."""
    results = json.loads((bench_run / "results.json").read_text())
    report = (bench_run / "report.md").read_text()
    assert mismatches(report, results) == []
    for heading in ("Acceptance", "Throughput", "Latency", "Robustness", "Mixed batch"):
        assert f"## {heading}" in report
    for png in ("acceptance_per_position.png", "speedup_vs_batch.png", "latency_vs_rate.png"):
        assert (bench_run / png).stat().st_size > 1000


def test_draft_length_variants_side_by_side(models, tmp_path):
    """The throughput suite serves the EDSD drafter statically, with the adaptive draft length
    and with vLLM's batch-size table, at T=0 and T=1, and reports the draft length each used:
    K for static drafts; K at batch 1 and about K/2 at batch 8 under the table; fewer tokens than
    static under the adaptive rule (this drafter has random weights: its drafts are unsure).
    Without speculation is left out: nothing here divides by it."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "bench", "throughput", "--quick", "--out", str(out), "--target", models["llama"],
           "--edsd", models["llama-edsd"], "--methods", "edsd,edsd-adaptive,edsd-batch-table",
           "--temperatures", "0,1", "--batch-sizes", "1,8"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=IN_PROCESS)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads((out / "results.json").read_text())
    rows = {(r["method"], r["batch_size"], r["temperature"]): r for r in results["runs"]}
    assert set(rows) == {(m, b, t) for m in ("edsd", "edsd-adaptive", "edsd-batch-table")
                         for b in (1, 8) for t in (0.0, 1.0)}
    for t in (0.0, 1.0):
        assert rows["edsd", 1, t]["mean_draft_length"] == rows["edsd", 8, t]["mean_draft_length"] == 4
        assert rows["edsd-batch-table", 1, t]["mean_draft_length"] == 4
        # Mostly K/2: steps while fewer than 5 of the 8 requests are scheduled draft K.
        assert rows["edsd-batch-table", 8, t]["mean_draft_length"] < 3
        for b in (1, 8):
            assert rows["edsd-adaptive", b, t]["draft_tokens"] < rows["edsd", b, t]["draft_tokens"]
    assert "| edsd-adaptive | 4 | 1 | 8 |" in (out / "report.md").read_text()


def test_step_cost_splits_whole_decode_steps(models, tmp_path):
    """``bench step-cost --quick`` with the toy target's EDSD drafter, one engine for batch 1 and
    8 (without speculation is left out to keep CI to one engine start; the unit tests split steps
    without a draft): every row's parts add up to its measured step within 5 %, none is negative,
    the drafter's forward and the plugin's hooks are there, and the report has a table per batch
    size."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "bench", "step-cost", "--quick", "--out", str(out), "--target", models["llama"],
           "--edsd", models["llama-edsd"], "--methods", "edsd"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads((out / "results.json").read_text())
    rows = {r["batch_size"]: r for r in results["runs"]}
    assert set(rows) == {1, 8} and {r["method"] for r in rows.values()} == {"edsd"}
    for row in rows.values():
        assert row["steps"] > 0 and row["dtype"] == "float32"
        assert abs(row["sum_over_step"] - 1) < 0.05, row
        parts = row["parts_ms"]
        assert min(parts.values()) >= -1e-6
        assert parts["target forward"] > 0 and parts["draft: drafter forward"] > 0 and parts["plugin hooks"] > 0
    report = (out / "report.md").read_text()
    assert "### Batch 1" in report and "### Batch 8" in report and "| part | edsd K=4 |" in report


def test_schedule_is_measured_then_served(models, tmp_path):
    """``bench schedule`` times none, K=0 (vLLM's table of one range with K 0), every request
    capped at 0 and each static K, writes a table vLLM accepts (from static K only), and times an
    engine serving it: at K=0 and capped at 0 nothing is drafted, at static K every draft is K
    long, and the served table drafts its own K at batch 1."""
    from vllm.v1.spec_decode.dynamic.utils import validate_and_normalize_dynamic_sd_schedule

    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "bench", "schedule", "--quick", "--max-k", "1", "--out", str(out),
           "--target", models["llama"], "--drafter", models["llama-edsd"]]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=IN_PROCESS)
    assert proc.returncode == 0, proc.stderr[-4000:]
    schedule = json.loads((out / "schedule.json").read_text())
    ranges = schedule["num_speculative_tokens_per_batch_size"]
    validate_and_normalize_dynamic_sd_schedule(ranges)
    results = json.loads((out / "results.json").read_text())
    assert results["schedule"] == schedule
    rows = {(r["engine"], r["batch_size"]): r for r in results["runs"]}
    assert set(rows) == {(e, b) for e in ("none", "opted-out", 0, 1, "schedule") for b in (1, 4)}
    for b in (1, 4):
        assert rows["none", b]["draft_tokens"] == rows[0, b]["draft_tokens"] == 0
        assert rows["opted-out", b]["draft_tokens"] == 0
        assert rows[1, b]["mean_draft_length"] == 1
    k_at_1 = ranges[0][2]
    assert rows["schedule", 1]["mean_draft_length"] == k_at_1
    assert f"`{json.dumps(schedule)}`" in (out / "report.md").read_text()


def test_serve_times_vllms_own_client_against_servers_as_users_start_them(tmp_path):
    """``bench serve`` on the embedded demo pair: ``vllm bench serve`` answers every held-out
    prompt from the server without speculation and from the EDSD server, which drafts, and whose
    log says the plugin chose sampled drafts (the config leaves ``draft_sample_method`` out); with
    ``--eager`` both servers start without torch.compile, and the report says so."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "bench", "serve", "--out", str(out), "--num-prompts", "2", "--output-len", "8",
           "--dtypes", "float32", "--eager"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads((out / "results.json").read_text())
    rows = {r["label"]: r for r in results["runs"]}
    assert set(rows) == {"none", "edsd K=4"}
    for row in rows.values():
        assert (row["completed"], row["served_dtype"]) == (2, "float32")
        assert 0 < row["total_output_tokens"] <= 16 and row["output_throughput"] > 0
    assert rows["none"]["counters"]["drafts"] == 0 < rows["edsd K=4"]["counters"]["drafts"]
    log = (out / "server-edsd_K=4-float32.log").read_text()
    assert "\"draft_sample_method\": 'probabilistic', as it was not set" in log
    assert "enforce_eager=True" in log
    report = (out / "report.md").read_text()
    assert "| edsd K=4 | float32 (float32) |" in report and "servers eager (--enforce-eager)" in report


def test_stop_at_eos_ends_replies_where_the_model_ends_its_answer(tmp_path):
    """``--stop-at-eos`` on the embedded demo target (a real chat model, which ends its answers):
    the acceptance suite of two ``--categories`` at T=0 (``--temperatures``) in float32
    (``--dtype``), eager. The first instruction and summarization prompts' greedy answers end
    after 67 and 55 tokens (transformers, float32), so each reply ends before --max-tokens,
    which ignore_eos (the default, every reply exactly --max-tokens) never does. Prompt lookup's
    greedy replies are the target's own, as the report says."""
    out, max_tokens, categories = tmp_path / "out", 96, ("instruction", "summarization")
    cmd = [sys.executable, "-m", "bench", "acceptance", "--stop-at-eos", "--out", str(out), "--methods", "none,ngram",
           "--categories", ",".join(categories), "--prompts-per-category", "1", "--max-tokens", str(max_tokens),
           "--temperatures", "0", "--dtype", "float32", "--eager"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=IN_PROCESS)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["ignore_eos"] is False and results["config"]["categories"] == list(categories)
    rows = {(r["method"], r["category"], r["temperature"]): r for r in results["runs"]}
    assert sorted(rows) == sorted((m, c, 0.0) for m in ("none", "ngram") for c in categories)
    assert {r["dtype"] for r in rows.values()} == {"float32"}
    assert 0 < max(r["output_tokens"] for r in rows.values()) < max_tokens
    assert [rows["ngram", c, 0.0]["same_replies"] for c in categories] == [1, 1]
    assert sum(rows["ngram", c, 0.0]["drafts"] for c in categories) > 0
    report = (out / "report.md").read_text()
    assert "(--stop-at-eos)" in report and "| ngram | 4 | 0 | summarization | float32 |" in report


@pytest.mark.parametrize("argv, message", [(["--methods", "none,edsd-fancy"], "unknown method(s) edsd-fancy"),
                                           (["--categories", "chat,poetry"], "unknown categor(ies) poetry")])
def test_bad_bench_arguments_are_one_line(argv, message, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "bench", "throughput", "--out", str(tmp_path / "out"), *argv],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and message in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()
