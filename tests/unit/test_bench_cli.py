"""``python -m bench``: one entry for every suite, whose ``--help`` lists each suite on one line;
the bench's code kept within its size limits and free of method names written by hand."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

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


def strings(tree: ast.AST) -> list[tuple[int, str]]:
    """Every string constant of a module but its docstrings."""
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef)) and node.body
                  and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings]


def test_method_names_come_from_the_registry():
    """``vllm_edsd/methods/registry.py`` is the one place a method's name is written."""
    found = [f"{path.name}:{line}: {text!r}" for path in sorted(BENCH.glob("*.py"))
             for line, text in strings(ast.parse(path.read_text())) if METHOD_NAME.search(text)]
    assert found == []


def test_modules_and_functions_stay_small():
    too_long = []
    for path in sorted(BENCH.glob("*.py")):
        source = path.read_text()
        if len(source.splitlines()) > 400:
            too_long.append(f"{path.name}: {len(source.splitlines())} lines")
        too_long += [f"{path.name}:{node.name}: {node.end_lineno - node.lineno + 1} lines"
                     for node in ast.walk(ast.parse(source))
                     if isinstance(node, ast.FunctionDef) and node.end_lineno - node.lineno >= 60]
    assert too_long == []
