"""``python -m bench index``: bench/results/README.md, the index of the results folders: each
one's suite, machine, dtype, date and the command that made it, so that a figure's source is
found without opening every folder.

Everything is read from the folders' own files: a ``results.json`` (and any other JSON file
with a ``machine`` block) gives one row, from its ``machine`` block, its ``command`` and its
rows' dtypes; a folder of Markdown tallies alone (CI runs, demo runs) gives a row per tally, from
its ``Command:`` and ``Machine:`` lines. A field no file holds is written "not recorded". A unit
test regenerates the index and fails when the committed one differs.
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass
from pathlib import Path

NOT_RECORDED = "not recorded"
NOT_BENCH = "not a bench suite"
README = "README.md"
SIDE_FILES = ("client-", "schedule.json", "sharegpt-held-out.json")  # JSON beside a results.json, not results
SUITE = re.compile(r"python -m bench ([\w-]+)")
DTYPE = re.compile(r"(?<![\w-])(float16|bfloat16|float32)\b")
SPAN = re.compile(r"`([^`]+)`")
FIELD = re.compile(r"(Commands?|Written by|[Mm]achine|command):?\s*(.*)")


@dataclass(frozen=True)
class Entry:
    """One row of the index: a results file, or the folder holding ``results.json``."""

    path: str  # relative to the results folder
    suite: str
    machine: str
    tag: str | None  # what the folder's name says of the machine: avx512, avx2, else the processor's maker
    dtype: str
    date: str
    command: str


def header(markdown: str) -> dict[str, str]:
    """The command and machine paragraphs of a report's head (before its first table), each
    on one line, and the dtypes the head names."""
    head = markdown.split("\n|", 1)[0]
    fields: dict[str, str] = {}
    for paragraph in re.split(r" {2}\n|\n\n", head):
        found = FIELD.match(" ".join(paragraph.split()))
        if found:
            key = "machine" if found.group(1).lower() == "machine" else "command"
            fields.setdefault(key, found.group(2))
    return fields | {"dtypes": ", ".join(sorted(set(DTYPE.findall(head))))}


def first_command(text: str | None) -> str:
    spans = SPAN.findall(text or "")
    return spans[0] if spans else NOT_RECORDED


def suite_of(command: str) -> str:
    if command == NOT_RECORDED:
        return NOT_RECORDED
    found = SUITE.match(command)
    return found.group(1) if found else NOT_BENCH


def recorded_command(data: dict) -> str | None:
    """The command a results file records: whole, or (cold starts) as its arguments alone."""
    from .cold_starts import command

    if "command" in data or "config" in data:
        return data.get("command") or data["config"].get("command")
    return command(data) if "argv" in data else None


def dtypes(data: dict) -> str:
    """The engines' dtypes a results file records, by row or for the whole file."""
    rows = [data, *data.get("runs", []), *data.get("points", [])]
    found = {r.get("served_dtype") or r.get("dtype") for r in rows if isinstance(r, dict)}
    return ", ".join(sorted(d for d in found if d and d != "auto")) or NOT_RECORDED


def client_dates(folder: Path) -> str | None:
    """The dates ``vllm bench serve`` stamped on its result files (YYYYMMDD-HHMMSS), as days."""
    days = sorted({f"{d[:4]}-{d[4:6]}-{d[6:8]}" for f in folder.glob("client-*.json")
                   if (d := str(json.loads(f.read_text()).get("date", "")))})
    return " to ".join(dict.fromkeys((days[0], days[-1]))) if days else None


def machine_text(machine: dict) -> str:
    return f"{machine.get('processor', '?')} ({machine.get('cpu_instruction_set') or 'CPU flags not recorded'})"


def machine_tag(machine: dict) -> str | None:
    """avx512 or avx2 from the CPU flags; where they were not recorded, epyc or xeon."""
    flags = machine.get("cpu_instruction_set") or ""
    names = [tag for tag in ("avx512", "avx2") if tag in flags]
    names += [maker for maker in ("epyc", "xeon") if maker in machine.get("processor", "").lower()]
    return names[0] if names else None


def first_clause(text: str) -> str:
    """``text`` up to its first semicolon outside brackets."""
    depth = 0
    for at, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == ";" and depth == 0:
            return text[:at]
    return text.rstrip(".")


def json_entry(path: Path, root: Path) -> Entry:
    data = json.loads(path.read_text())
    folder = path.parent
    report = folder / "report.md" if path.name == "results.json" else path.with_suffix(".md")
    head = header(report.read_text()) if report.is_file() else {}
    command = recorded_command(data) or first_command(head.get("command"))
    machine = data.get("machine") or {}
    date = machine.get("date") or client_dates(folder) or NOT_RECORDED
    where = folder if path.name == "results.json" else path
    return Entry(where.relative_to(root).as_posix(), suite_of(command),
                 machine_text(machine) if machine else NOT_RECORDED, machine_tag(machine),
                 dtypes(data), date, command)


def markdown_entry(path: Path, root: Path) -> Entry:
    head = header(path.read_text())
    command = first_command(head.get("command"))
    machine = first_clause(head.get("machine", NOT_RECORDED))
    return Entry(path.relative_to(root).as_posix(), suite_of(command), machine, None,
                 head["dtypes"] or NOT_RECORDED, NOT_RECORDED, command)


def is_results(path: Path) -> bool:
    """A results file: results.json, or another JSON file that carries a machine block."""
    if path.name == "results.json":
        return True
    if path.name.startswith(SIDE_FILES):
        return False
    data = json.loads(path.read_text())
    return isinstance(data, dict) and "machine" in data


def entries(root: Path) -> list[Entry]:
    """Every row of the index of ``root``, folder by folder."""
    rows = []
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        files = sorted((p for p in folder.rglob("*") if p.is_file()), key=lambda p: (p.parent != folder, p))
        if not files:  # a run that has written nothing yet; git keeps no empty folder
            continue
        found = [json_entry(p, root) for p in files if p.suffix == ".json" and is_results(p)]
        found = found or [markdown_entry(p, root) for p in files if p.suffix == ".md" and p.name != README]
        rows += found or [Entry(folder.name, *[NOT_RECORDED] * 2, None, *[NOT_RECORDED] * 3)]
    return rows


def cell(text: str) -> str:
    return text.replace("|", "\\|")


def link(entry: Entry, root: Path) -> str:
    target = root / entry.path
    target = target / "report.md" if (target / "report.md").is_file() else target
    return f"[{entry.path}]({target.relative_to(root).as_posix()})"


def render(root: Path) -> str:
    lines = ["# Results index", "",
             "Every results folder of the bench, one row per results file: its suite, the machine (processor and "
             "CPU flags) and dtype it was measured on, the day the run started, and the command that made it. "
             "Written by `python -m bench index` from the folders' own files (a `results.json`'s machine block "
             f"and command, else a report's `Command:` and `Machine:` lines); \"{NOT_RECORDED}\" where they do "
             "not say. Do not edit by hand: a unit test fails when this file is not what the command writes.", "",
             "| results | suite | machine | dtype | date | command |", "|---|---|---|---|---|---|"]
    for e in entries(root):
        command = f"`{cell(e.command)}`" if e.command != NOT_RECORDED else NOT_RECORDED
        lines.append(f"| {link(e, root)} | {e.suite} | {cell(e.machine)} | {e.dtype} | {e.date} | {command} |")
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    root = Path(args.results)
    (root / README).write_text(render(root))
    print(f"wrote {root / README}")
    return 0
