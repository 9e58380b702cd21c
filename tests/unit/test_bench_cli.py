"""``python -m bench``: one entry for every suite, whose ``--help`` lists each suite on one line
(sizes and method names of bench's code: tests/unit/test_package_architecture.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.cli import SUITES, parse

BENCH = Path(__file__).resolve().parents[2] / "bench"
METHOD_NAME = re.compile(r"(?<![\w.-])(edsd|eagle3)(?!\w)(?! (?:train|build-demo|convert)\b)")  # not the `edsd` command


def test_the_help_lists_every_suite_on_one_line():
    out = subprocess.run([sys.executable, "-m", "bench", "--help"], capture_output=True, text=True, check=True,
                         env={**os.environ, "COLUMNS": "80"}, cwd=BENCH.parent).stdout
    lines = out.splitlines()
    for name, suite in SUITES.items():
        assert any(line.split() == [name, *suite.help.split()] for line in lines), name


def test_each_suite_parses_its_own_options_and_records_its_command():
    args = parse(["schedule", "--out", "x", "--max-k", "2"])
    assert (args.suite, args.max_k, args.command) == ("schedule", 2, "python -m bench schedule --out x --max-k 2")
    args = parse(["serve", "--out", "x", "--speculative-config", '{"method": "ngram"}'])
    assert args.command == """python -m bench serve --out x --speculative-config '{"method": "ngram"}'"""
    assert parse(["learning-curve", "--out", "x"]).sizes == "64,180,360,720"
    assert parse(["vocab-coverage", "T", "--data", "d"]).held_out == 1000


def test_learning_curve_train_only_is_not_a_measurement_of_trained_drafters(tmp_path):
    """``--train-only`` (a machine without vLLM) trains; ``--drafters-from`` measures what is
    trained: both at once is refused in one line before any stage runs."""
    from bench.learning_curve import checked
    from vllm_edsd.errors import EDSDError

    args = parse(["learning-curve", "--out", "x", "--sizes", "8", "--train-only", "--drafters-from", str(tmp_path)])
    with pytest.raises(EDSDError, match="--train-only trains; --drafters-from measures"):
        checked(args)
    assert parse(["learning-curve", "--out", "x", "--train-only"]).train_only
