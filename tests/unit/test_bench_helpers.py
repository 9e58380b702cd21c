"""The bench's helpers on their own, no engine: speed-up ratios, the Poisson arrival schedule,
latency summaries from raw timings, a missing optional dependency and bad numbers as one line, and what a report
says of its replies' length."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bench.latency import NOT_COMPLETED, aggregate, poisson_schedule, summary
from bench.offline import with_derived


def test_relative_figures_come_from_rows_of_the_same_kind():
    """Speed-ups divide by the no-speculation row of the same suite, batch size and temperature
    (a row without one gets None); τ drops compare with the same method's default system prompt."""
    def row(suite, method, tps, batch=1, temperature=0.0, **extra):
        return {"suite": suite, "method": method, "k": 4, "batch_size": batch, "temperature": temperature,
                "category": "chat", "output_tokens_per_s": tps, **extra}

    runs = with_derived([row("throughput", "none", 10.0), row("throughput", "edsd", 15.0),
                         row("throughput", "edsd", 15.0, batch=2), row("throughput", "edsd", 5.0, temperature=1.0),
                         row("acceptance", "none", 20.0), row("acceptance", "edsd", 15.0),
                         row("robustness", "edsd", 1.0, system_prompt="default", tau=2.0),
                         row("robustness", "edsd", 1.0, system_prompt="system-0", tau=1.5)])
    assert [r.get("speedup") for r in runs] == [1.0, 1.5, None, None, 1.0, 0.75, None, None]
    assert [r["tau_drop"] for r in runs[6:]] == [0.0, -0.25]


def test_same_replies_count_greedy_replies_equal_to_the_target_alone():
    """At T=0 a row counts its replies equal, in order, to the no-speculation row's of the same
    category; sampled rows, rows without a baseline and rows written before the digests existed
    are not compared, and the report says so with a dash."""
    from bench.offline import reply_digest
    from bench.report import _same_replies

    a, b, c = (reply_digest(ids) for ids in ([1, 2, 3], [4, 5], [4, 6]))
    assert a != reply_digest([1, 2]) and b != c and reply_digest((4, 5)) == b

    def row(method, digests, temperature=0.0, category="chat"):
        return {"suite": "acceptance", "method": method, "k": 4, "batch_size": 1, "category": category,
                "temperature": temperature, "output_tokens_per_s": 1.0, "reply_digests": digests}

    runs = with_derived([row("none", [a, b]), row("edsd", [a, c]), row("ngram", [b, a]), row("none", [a, b], 1.0),
                         row("edsd", [a, b], 1.0), row("edsd", [a, b], category="math"),
                         {k: v for k, v in row("eagle3", [a, b]).items() if k != "reply_digests"}])
    assert [r["same_replies"] for r in runs] == [2, 1, 0, None, None, None, None]
    assert [_same_replies(r) for r in runs[:4]] == ["2/2", "1/2", "0/2", "–"]


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
            f"from bench.cli import main; sys.exit(main([{suite!r}, '--out', {str(out)!r}, '--quick']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"missing {package}" in proc.stderr and "pip install 'vllm-edsd[bench]'" in proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()


def test_plots_skip_speedups_without_a_baseline(tmp_path):
    """A run without "none" has no speed-ups to plot (its log-scaled axis would have no data):
    the plots are made from what there is, and nothing fails."""
    from bench.report import plots

    rows = [{"suite": "throughput", "method": "edsd", "k": 4, "batch_size": b, "temperature": 0.0,
             "output_tokens_per_s": 10.0 * b} for b in (1, 8)]
    assert plots({"runs": with_derived(rows)}, tmp_path) == []
    rows.append({"suite": "throughput", "method": "none", "k": 0, "batch_size": 1, "temperature": 0.0,
                 "output_tokens_per_s": 5.0})
    assert [p.name for p in plots({"runs": with_derived(rows)}, tmp_path)] == ["speedup_vs_batch.png"]


LEARNING_CURVE_MACHINE = {"processor": "CPU X", "cpu_instruction_set": "avx2", "cores": 2, "vllm": "0.32.0"}


def test_learning_curve_report_and_plot(tmp_path):
    """The learning curve's table has one row per (method, size) with its positions and τ, names
    the machine and dtype, and the plot is written."""
    from bench.learning_curve import plot, render

    points = [{"method": m, "conversations": n, "positions": n * 150, "tau": 1.2 + n / 1000 + (m == "edsd") / 10,
               "acceptance_per_pos": [0.2, 0.05, 0.01, 0.0], "drafts": 10, "dtype": "bfloat16",
               "train_wall_s": 60.0 * n / 64, "train_acc_per_step": [0.5, 0.4], "tau_seen": 1.5 + n / 1000}
              for m in ("eagle3", "edsd") for n in (64, 720)]
    points[0].pop("tau_seen")  # a point measured before the seen prompts were
    points[3]["tau_sequence"] = 1.9
    results = {"command": "python -m bench learning-curve --out x", "machine": LEARNING_CURVE_MACHINE, "k": 4,
               "held_out": "the bench's prompts", "seen": "the first 20 training prompts", "points": points}
    table = render(results)
    assert "CPU X (avx2), 2 cores" in table and "target served in bfloat16" in table and "°" not in table
    points[1]["weights_rounded_to"] = "float16"  # carried back from a GPU machine (bench.gpu_runs unpack)
    rounded = render(results)
    assert "drafters trained in float32, those marked ° carried back from a GPU machine in float16" in rounded
    assert "| eagle3 ° | 720 |" in rounded and rounded.count("°") == 2
    assert "| edsd | 720 | 108,000 | 2.020 | 1.900 | 0.20 / 0.05 / 0.01 / 0.00 | 2.220 | 0.50 | 11.2 min |" in table
    assert "| eagle3 | 64 | 9,600 | 1.264 | - | 0.20 / 0.05 / 0.01 / 0.00 | - | 0.50 | 1.0 min |" in table
    assert "Seen: the first 20 training prompts." in table and table.count("| eagle3 |") == 2
    assert "Command: `python -m bench learning-curve --out x`" in table and "| run |" not in table
    plot(results, tmp_path / "curve.png")
    assert (tmp_path / "curve.png").stat().st_size > 1000


def test_learning_curve_report_names_each_runs_command():
    """A results file that merges several runs (an ablation beside the main curve) names every
    run's command and, in each row, the run that measured it; a point written before points kept
    their command is the file's."""
    from bench.learning_curve import render

    base = {"conversations": 64, "positions": 9600, "tau": 1.3, "acceptance_per_pos": [0.3, 0.0], "drafts": 10,
            "dtype": "float32", "train_wall_s": 60.0, "train_acc_per_step": [0.5, 0.4]}
    ablation = "python -m bench learning-curve --out x --methods edsd '--train-extra=--lr 5e-4'"
    points = [{**base, "method": "eagle3"},
              {**base, "method": "edsd", "variant": "--lr 5e-4", "command": ablation}]
    table = render({"command": "python -m bench learning-curve --out x", "machine": LEARNING_CURVE_MACHINE, "k": 4,
                    "held_out": "h", "points": points}).splitlines()
    assert "Commands: the 2 runs listed below the table.  " in table and not any("Command:" in r for r in table)
    assert table[-2:] == ["1. `python -m bench learning-curve --out x`", f"2. `{ablation}`"]
    assert next(r for r in table if r.startswith("| eagle3 |")).endswith(" 1 |")
    assert next(r for r in table if r.startswith("| edsd ")).endswith(" 2 |")


@pytest.mark.parametrize("argv, message", [(["--sizes", "64,x"], "--sizes takes comma-separated ints, each at least 1"),
                                           (["--methods", "edsd,medusa"], "unknown method(s) medusa"),
                                           (["--sizes", "0,64"], "got '0' in '0,64'"),
                                           (["--feature-layers", "1,-2"], "--feature-layers takes comma-separated"),
                                           (["--sizes", "64,128", "--drafters-from", "run"],
                                            "--drafters-from measures one run"),
                                           (["--sizes", "64", "--drafters-from", "nowhere"],
                                            "nowhere/edsd/final is not a finished checkpoint")])
def test_learning_curve_refuses_bad_arguments_in_one_line(argv, message, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "bench", "learning-curve", "--out", str(tmp_path / "out"),
                           "--work", str(tmp_path / "work"), *argv], capture_output=True, text=True)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()


def test_sequence_tau_counts_every_target_forward():
    """Whole-sequence τ: output tokens over forwards (output tokens less accepted drafts)."""
    from bench.offline import sequence_tau

    assert sequence_tau(100, 0) == 1.0  # no speculation, or nothing accepted
    assert sequence_tau(100, 50) == 2.0  # 50 forwards gave 100 tokens
    # ngram drafting on 10 of 60 steps, 3 accepted each: per draft τ 4.0, per sequence 90 / 60
    assert sequence_tau(90, 30) == pytest.approx(1.5)
    assert sequence_tau(0, 0) is None


def test_report_says_how_long_the_replies_were():
    """A report says whether replies ran to max_tokens or ended at EOS; results written before
    ``--stop-at-eos`` existed (no ``config.ignore_eos``) always ran to max_tokens."""
    from bench.report import render

    results = Path(__file__).parents[2] / "bench" / "results" / "learning-curve-10k-avx512"
    older = json.loads((results / "speed-after-epoch-2" / "results.json").read_text())
    stopped = json.loads((results / "speed-stop-at-eos" / "results.json").read_text())
    assert "ignore_eos" not in older["config"] and stopped["config"]["ignore_eos"] is False
    assert "generated to max_tokens (ignore_eos)" in render(older)
    assert "ended at the model's end of sequence (--stop-at-eos)" in render(stopped)
    assert "(--stop-at-eos)" not in render(older)


def test_report_header_names_the_dtype_every_row_ran_in():
    """``--dtype float32`` on a bf16 machine: the header says float32, not the machine's default."""
    from bench.report import _engines_dtype

    machine = {"default_dtype": "bfloat16"}
    assert _engines_dtype([{"dtype": "float32"}, {"dtype": "float32"}], machine) == "engines' dtype: float32"
    assert "bfloat16 by default" in _engines_dtype([{"dtype": "float32"}, {"dtype": "bfloat16"}], machine)


def _setup(*argv: str):
    from bench.cli import parse
    from bench.suites import build_setup

    return build_setup(parse(["acceptance", "--out", "unused", "--target", "T", "--edsd", "E", *argv]))


def test_temperatures_apply_to_acceptance_and_throughput_alike():
    """Without --temperatures acceptance measures T=0 and T=1 and throughput T=0; with it both
    measure exactly the temperatures given (a greedy-only acceptance run takes half the time)."""
    default = _setup()
    assert (default.acceptance_temperatures, default.temperatures) == ([0.0, 1.0], [0.0])
    chosen = _setup("--temperatures", "0,0.7", "--k", "2,3", "--batch-sizes", "1,8")
    assert (chosen.acceptance_temperatures, chosen.temperatures) == ([0.0, 0.7], [0.0, 0.7])
    assert (chosen.ks, chosen.batch_sizes) == ([2, 3], [1, 8])
    assert (default.seed, _setup("--seed", "7").seed) == (0, 7)


@pytest.mark.parametrize("argv, message", [
    (["--k", "4,a"], "--k takes comma-separated ints, each at least 1; got 'a' in '4,a'"),
    (["--k", "0"], "--k takes comma-separated ints, each at least 1; got '0'"),
    (["--batch-sizes", "1,,4"], "--batch-sizes takes comma-separated ints"),
    (["--temperatures", "-1"], "--temperatures takes comma-separated floats, each at least 0; got '-1'"),
    (["--temperatures", "nan"], "--temperatures takes comma-separated floats"),
    (["--max-tokens", "0"], "--max-tokens must be at least 1, got 0"),
    (["--prompts-per-category", "-2"], "--prompts-per-category must be at least 1, got -2"),
    (["--seed", "-1"], "--seed must be at least 0, got -1"),
])
def test_bad_numbers_are_refused_naming_the_flag(argv, message):
    from vllm_edsd.errors import EDSDError

    with pytest.raises(EDSDError) as refused:
        _setup(*argv)
    assert message in str(refused.value)


def test_bad_request_rate_is_refused_before_any_engine(tmp_path):
    """--qps is read where the latency suite is planned, still before anything runs: one line,
    exit 2, nothing written."""
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "bench", "latency", "--out", str(out), "--target", "T",
                           "--edsd", "E", "--qps", "1,0"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "--qps takes comma-separated floats, each above 0; got '0'" in proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()


def test_the_learning_curves_base_is_the_recipe_without_its_architecture(tmp_path):
    """A learning-curve run is named by its ``--train-extra`` alone, so its base is the demo
    recipe's data and optimizer with none of the shipped drafters' switches, EDFuse at the
    target's FFN width, in float32, whatever ``pipeline.toml`` ships."""
    from bench.learning_curve import demo_plan

    base = demo_plan(argparse.Namespace(work=str(tmp_path), device="cpu", chat_prompts=8, code_prompts=0), 8)
    for method in ("edsd", "eagle3"):
        plain = base.train_options(method)
        assert (plain.autocast, plain.fuse_intermediate_size) == (None, None)
        assert not any((plain.attention_reads_token, plain.feature_norm, plain.fuse_residual, plain.norm_before_fc,
                        plain.fc_norm, plain.norm_before_residual, plain.norm_output))
        assert (plain.lr, plain.lr_schedule, plain.weight_decay, plain.epochs) == (0.001, "cosine", 0, 3)
    assert base.train_options("edsd").token_norm == "layernorm"


def test_an_ablation_that_names_its_layers_replaces_edselects():
    from bench.learning_curve import own_layers

    argv = ["train", "T", "--method", "edsd", "--layers-from", "layers.json", "--data", "d.json"]
    assert own_layers(argv, ["--epochs", "3"]) == argv
    assert own_layers(argv, ["--layers", "2,27"]) == ["train", "T", "--method", "edsd", "--data", "d.json"]
    eagle3 = ["train", "T", "--method", "eagle3", "--data", "d.json"]
    assert own_layers(eagle3, ["--layers", "2,15,27"]) == eagle3


def test_the_report_rows_carry_the_values_of_results_json():
    """A recorded run of every suite (bench/results/all-avx512): each run is its row of the
    report, in order, with its numbers; a changed number or a missing run is found."""
    from support.report_tables import mismatches

    from bench.report import render

    results = json.loads((Path(__file__).parents[2] / "bench/results/all-avx512/results.json").read_text())
    report = render(results)
    assert mismatches(report, results) == []
    assert {r["suite"] for r in results["runs"]} == {"acceptance", "throughput", "latency", "robustness", "mixed"}
    changed = json.loads(json.dumps(results))
    next(r for r in changed["runs"] if r["suite"] == "latency")["ttft_p50_s"] += 0.01
    assert [line.split(":")[0] for line in mismatches(report, changed)] == ["Latency row 0 TTFT p50"]
    acceptance = sum(r["suite"] == "acceptance" for r in results["runs"])
    del changed["runs"][0]
    assert f"Acceptance: {acceptance} rows for {acceptance - 1} runs" in mismatches(report, changed)


def test_cold_starts_quote_each_ignored_exception_with_its_reason():
    """What a start printed: vLLM's log lines, one exception Python ignored in a finaliser (its
    traceback, then its own line), the start's reply; the reply line is found among the logs."""
    from bench.cold_starts import ignored_exceptions

    output = "\n".join([
        "(Worker pid=7) INFO 11-27 12:43:05 [monitor.py:91] warm-up took 11.68 s",
        "Exception ignored in: <function CPUDNNLGEMMHandler.__del__ at 0x7f>",
        "Traceback (most recent call last):",
        '  File "vllm/_custom_ops.py", line 3728, in __del__',
        "    self.dtor(self.handler_tensor.item())",
        "RuntimeError: Tensor.item() cannot be called on meta tensors",
        "(Worker pid=7) INFO 11-27 12:43:16 [monitor.py:91] done",
    ])
    assert ignored_exceptions(output) == ["Exception ignored in: <function CPUDNNLGEMMHandler.__del__ at 0x7f> "
                                          "RuntimeError: Tensor.item() cannot be called on meta tensors"]
    assert ignored_exceptions("(Worker pid=7) INFO nothing ignored") == []


def test_the_lookup_column_says_what_the_lookup_drafted_and_how_much_held():
    from bench.report import _lookup_share

    row = {"draft_sources": {"lookup": {"draft_tokens": 200, "accepted": 90},
                             "drafter": {"draft_tokens": 600, "accepted": 150}}}
    assert _lookup_share(row) == "90/200 (45%), 25% of drafts"
    assert _lookup_share({"draft_sources": None}) == _lookup_share({}) == "–"
    nothing = {"lookup": {"draft_tokens": 0, "accepted": 0}, "drafter": {"draft_tokens": 0, "accepted": 0}}
    assert _lookup_share({"draft_sources": nothing}) == "0/0"


def test_a_target_given_needs_its_own_drafter(tmp_path):
    """The demo's drafters fill in for the demo's target only: a target given without a drafter
    is one line, whatever the bench; ``none`` needs no drafter."""
    from bench.arguments import target_and_drafter
    from vllm_edsd.errors import EDSDError

    with pytest.raises(EDSDError, match="no edsd drafter: pass --drafter"):
        target_and_drafter(str(tmp_path), "edsd", None)
    assert target_and_drafter(str(tmp_path), "none", None) == (str(tmp_path), None)
    assert target_and_drafter(str(tmp_path), "eagle3", "d") == (str(tmp_path), "d")


def test_rounds_run_every_engine_again_in_alternating_order(tmp_path):
    """``--rounds 3``: the offline engines three times, the order reversed every other round; speed-ups
    divide by no speculation of the same round, and the report adds each method's tok/s per round
    and over the rounds (tokens over seconds, every category together). One round adds nothing."""
    from bench.cli import parse
    from bench.report import render
    from bench.suites import build_setup, measurements
    from vllm_edsd.errors import EDSDError

    args = parse(["acceptance", "--out", str(tmp_path), "--target", "t", "--edsd", "e", "--eagle3", "e3",
                  "--methods", "none,eagle3,edsd", "--rounds", "3"])
    labels = [label for label, _, _ in measurements(build_setup(args), (args.suite,), args)]
    order = ["none", "eagle3 K=4", "edsd K=4"]
    assert labels == [f"{m}, round {n}/3" for n, ms in ((1, order), (2, order[::-1]), (3, order)) for m in ms]
    with pytest.raises(EDSDError, match="--rounds must be at least 1, got 0"):
        build_setup(parse(["acceptance", "--out", str(tmp_path), "--target", "t", "--rounds", "0"]))

    def row(method, k, category, round_number, tokens, seconds):
        return {"suite": "acceptance", "method": method, "k": k, "temperature": 0.0, "category": category,
                "round": round_number, "output_tokens": tokens, "elapsed_s": seconds, "dtype": "float32",
                "output_tokens_per_s": tokens / seconds, "tau": None, "tau_sequence": 1.0, "acceptance_per_pos": []}

    rows = [row("none", 0, c, n, 100, 10.0) for n in (0, 1) for c in ("chat", "code")]
    rows += [row("edsd", 4, "chat", 0, 100, 5.0), row("edsd", 4, "code", 0, 100, 15.0),
             row("edsd", 4, "chat", 1, 100, 4.0), row("edsd", 4, "code", 1, 100, 4.0)]
    runs = with_derived(rows)
    assert [r["speedup"] for r in runs if r["method"] == "edsd"] == [2.0, 100 / 15 / 10, 2.5, 2.5]
    report = render({"machine": {"processor": "p", "cores": 2, "accelerator": "none", "vllm": "v", "torch": "t",
                                 "vllm_edsd": "e"},
                     "config": {"target": "t", "drafters": {}, "command": "c", "ignore_eos": True}, "runs": runs})
    assert "| edsd | 4 | 0 | chat · round 2 | float32 |" in report  # the acceptance table marks round 2
    assert "| edsd | 4 | 0 | float32 | 10.0 / 25.0 | 14.3 | 1.00 / 2.50 |" in report  # 400 tokens in 28 s
    one_round = render({"machine": {"processor": "p", "cores": 2, "accelerator": "none", "vllm": "v", "torch": "t",
                                    "vllm_edsd": "e"},
                        "config": {"target": "t", "drafters": {}, "command": "c", "ignore_eos": True},
                        "runs": with_derived([r for r in rows if r["round"] == 0])})
    assert "over the rounds" not in one_round
