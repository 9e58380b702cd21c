"""The draft vocabulary's coverage of held-out answers (``python -m bench vocab-coverage``): the
share of answer tokens a vocabulary built as ``edsd train`` builds it can ever draft."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from support.toy import make_target, toy_corpus

from bench.cli import main
from vllm_edsd.training.draft_vocab import build_vocab_mapping, coverage


def test_coverage_counts_the_tokens_a_vocabulary_holds():
    t2d = torch.zeros(10, dtype=torch.bool)
    t2d[[1, 4]] = True
    assert coverage(t2d, Counter({1: 3, 4: 1, 7: 4})) == 0.5
    assert coverage(t2d, Counter()) == 0.0
    _, t2d = build_vocab_mapping(Counter({5: 9, 2: 3, 8: 1}), 10, 2)  # the two most frequent
    assert coverage(t2d, Counter({5: 1, 2: 1, 8: 2})) == 0.5


@pytest.fixture(scope="module")
def answered(tmp_path_factory):
    root = tmp_path_factory.mktemp("coverage")
    target = make_target(root / "target", vocab_size=384)
    lines = [line for line in toy_corpus().splitlines() if line.strip()]
    data = root / "answers.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": a},
                                                     {"role": "assistant", "content": b}]}) + "\n"
                            for a, b in zip(lines, lines[1:])))
    return str(target), str(data), len(lines) - 1


def test_coverage_grows_with_the_vocabulary_and_the_data(answered, capsys, tmp_path):
    target, data, count = answered
    assert main(["vocab-coverage", target, "--data", data, "--held-out", "8", "--train", f"4,{count - 8}",
                                "--sizes", "8,32,128,384", "--out", str(tmp_path / "out")]) == 0
    assert len(json.loads((tmp_path / "out" / "results.json").read_text())["rows"]) == 8
    table = capsys.readouterr().out
    rows = [line for line in table.splitlines() if line.startswith("| ") and "conversations |" in line]
    assert len(rows) == 2
    values = [[float(x) for x in row.split("|")[3:-1]] for row in rows]
    for row in values:
        assert row == sorted(row) and 0 < row[0] < 1 and row[-1] == 1.0  # the whole vocabulary covers all
    assert values[1][1] >= values[0][1]  # more training answers, a better vocabulary of one size


def test_bad_split_is_one_clear_error(answered, capsys):
    target, data, count = answered
    assert main(["vocab-coverage", target, "--data", data, "--held-out", str(count)]) == 2
    assert "--held-out must leave conversations to train on" in capsys.readouterr().err


@pytest.mark.parametrize(("flag", "value"), [("--sizes", "8,x"), ("--train", "0")])
def test_bad_counts_are_one_clear_error_naming_the_flag(answered, capsys, flag, value):
    target, data, _ = answered
    assert main(["vocab-coverage", target, "--data", data, "--held-out", "8", flag, value]) == 2
    assert f"{flag} takes comma-separated ints" in capsys.readouterr().err
