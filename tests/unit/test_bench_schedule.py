"""``python -m bench schedule``'s choice of vLLM's K-by-batch-size table from measured
throughput, and its refusals, without an engine."""

from __future__ import annotations

import subprocess
import sys

import pytest

from bench.cli import parse
from bench.schedule import checked, choose_schedule, render, schedule_config, static_k_throughput
from vllm_edsd.errors import EDSDError


def test_each_batch_size_gets_its_fastest_k_up_to_the_geometric_midpoint():
    tok_s = {1: {0: 20, 1: 24, 2: 27, 3: 26}, 4: {0: 60, 1: 70, 2: 66, 3: 60},
             16: {0: 150, 1: 140, 2: 120, 3: 100}, 64: {0: 300, 1: 250, 2: 200, 3: 150}}
    assert choose_schedule(tok_s, 256) == [[1, 2, 2], [3, 8, 1], [9, 256, 0]]


def test_neighbours_with_the_same_k_merge_and_ties_take_the_smaller_k():
    tok_s = {1: {1: 30, 2: 30}, 4: {1: 50, 2: 40}, 16: {1: 90, 2: 80}}
    assert choose_schedule(tok_s, 64) == [[1, 64, 1]]


def test_the_last_range_reaches_past_the_largest_measured_batch():
    assert choose_schedule({1: {0: 1, 4: 2}, 300: {0: 2, 4: 1}}, 256)[-1] == [18, 300, 0]


def test_the_config_keeps_k_at_least_one_even_when_nothing_drafts():
    """vLLM refuses ``num_speculative_tokens`` 0 beside a table; every K of the table is capped at it."""
    assert schedule_config([[1, 256, 0]]) == {"num_speculative_tokens": 1,
                                               "num_speculative_tokens_per_batch_size": [[1, 256, 0]]}
    assert schedule_config([[1, 2, 3], [3, 256, 1]])["num_speculative_tokens"] == 3


def test_nothing_measured_is_one_clear_error():
    with pytest.raises(EDSDError, match="no throughput measured"):
        choose_schedule({}, 256)


def test_only_static_k_engines_are_choices():
    runs = [{"engine": "none", "batch_size": 4, "output_tokens_per_s": 50.0},
            {"engine": "opted-out", "batch_size": 4, "output_tokens_per_s": 48.0},
            {"engine": 0, "batch_size": 4, "output_tokens_per_s": 45.0},
            {"engine": 1, "batch_size": 4, "output_tokens_per_s": 40.0}]
    assert static_k_throughput(runs) == {4: {0: 45.0, 1: 40.0}}
    assert choose_schedule(static_k_throughput(runs), 256) == [[1, 256, 0]]


def test_the_report_compares_every_engine_with_none_at_each_batch_size():
    machine = {"processor": "cpu", "cpu_instruction_set": "avx2", "cores": 2}
    runs = [{"engine": "none", "batch_size": 1, "output_tokens_per_s": 20.0, "dtype": "float32"},
            {"engine": 0, "batch_size": 1, "output_tokens_per_s": 19.0, "dtype": "float32"},
            {"engine": 2, "batch_size": 1, "output_tokens_per_s": 30.0, "dtype": "float32"}]
    report = render({"runs": runs, "machine": machine, "method": "edsd", "target": "t", "max_tokens": 16,
                     "command": "python -m bench schedule --out x", "schedule": schedule_config([[1, 256, 2]])})
    assert "| 1 | 20.0 | 19.0 (0.95x) | 30.0 (1.50x) |" in report
    assert "[[1, 256, 2]]" in report and "float32" in report


@pytest.mark.parametrize("flags, message", [
    (["--batch-sizes", "0,4"], "--batch-sizes takes comma-separated ints"),
    (["--max-k", "0"], "--max-k must be at least 1"),
    (["--max-tokens", "-1"], "--max-tokens must be at least 1"),
])
def test_bad_flags_are_refused(flags, message):
    with pytest.raises(EDSDError, match=message):
        checked(parse(["schedule", "--out", "x", *flags]))


def test_a_bad_flag_is_one_line_before_any_engine(tmp_path):
    done = subprocess.run([sys.executable, "-m", "bench", "schedule", "--out", str(tmp_path / "out"), "--max-k", "0"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--max-k must be at least 1" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "out").exists()
