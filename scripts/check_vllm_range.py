"""Check every vLLM name vllm-edsd depends on against the source of every supported vLLM release.

vllm-edsd claims a range of vLLM releases, but only the CPU builds installable here ever run
it. This script reads, with ``ast`` and without importing vLLM or needing a GPU, the source
distribution of the newest patch release of each vLLM minor from 0.24 to 0.33, and checks each
row against it:

* every row of the plugin's ``PATCHES`` and its ``REFUSAL`` (``vllm_edsd/serving/patches.py``),
  as its kind calls for (``vllm_names.expected``): a replaced method, an instance hook or an
  override has the signature the plugin's code expects (a hook on the proposer class vLLM
  instantiates), in the class or a vLLM base class it inherits from; a private attribute is
  defined or assigned there; an environment variable is one vLLM's ``envs`` reads; a config
  attribute is one vLLM's own code sets, or the row says why there is nothing to check; an
  exception's method exists;
* every name the plugin reads, calls or subclasses (``READ`` in
  ``vllm_edsd/serving/vllm_names.py``).

The expected shapes are recorded in ``vllm_names.py`` (not derived from one installed vLLM),
so a release that differs from the one the plugin was written against shows up as a break.
When the plugin starts to use another vLLM name, add it to ``READ``; a new row of ``PATCHES``
whose kind needs a recorded shape needs its entry in ``PATCHED`` (tests/unit/test_serving_vllm_range.py
fails without one). This is a static check: it finds names vLLM moved, renamed, removed or
reshaped, not changed behaviour.

A row judged on a release outside ``SUPPORTED_VLLM`` is "n/a" (the plugin refuses "edsd"
there, by ``REFUSAL``, which is checked on every release), as is a row whose ``versions`` leave
the release out. Where a row's entry has an ``applies_if`` (the condition the plugin itself
tests to choose between the CPU kernel rows), the condition must hold in exactly the releases
the row's ``versions`` claim: a release where they disagree is broken. Each cell: ``✓``
present with the expected shape; ``✗`` broken (the reason is listed under the table); ``–``
absent but optional (the plugin goes without it, as the row says); ``n/a``.

Source distributions come from PyPI (its JSON API) into a cache outside the repository,
checked against PyPI's sha256, resumed where a download stopped, and unpacked (the
``vllm/**.py`` files only) once. The table is printed and written as ``report.md`` and
``results.json`` (default: bench/results/vllm-range/). Exit status 1 when a row that applies
is broken, 2 when the releases could not be had.

Examples::

    python scripts/check_vllm_range.py                      # 0.24 ... 0.33, newest patch of each
    python scripts/check_vllm_range.py --releases 0.33.0    # one release
    python scripts/check_vllm_range.py --offline            # only what the cache holds
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]

# the package and the modules beside this script, not installed ones
from vllm_sdists import UNREACHABLE, read_listing, releases_from_listing, unpack  # noqa: E402
from vllm_source import Found, SourceTree, attributes_set  # noqa: E402

from vllm_edsd.serving.patches import PATCHES, REFUSAL  # noqa: E402
from vllm_edsd.serving.patching import Patch  # noqa: E402
from vllm_edsd.serving.versions import SUPPORTED_VLLM, version_supported  # noqa: E402
from vllm_edsd.serving.vllm_names import PATCHED, READ, VllmName, expected  # noqa: E402

DEFAULT_CACHE = Path.home() / ".cache" / "vllm-edsd" / "vllm-sdists"
DEFAULT_OUT = ROOT / "bench" / "results" / "vllm-range"
SHOWN_PARAMETERS = 8  # a reason quotes a signature up to this many parameters

OK, BROKEN, ABSENT, NOT_APPLICABLE = "✓", "✗", "–", "n/a"


def signature_problem(expected: str, actual: list[str]) -> str | None:
    """Why ``actual`` parameters do not fit ``expected`` (vllm_names.py's notation), or None."""
    parts = [p.strip() for p in expected.split(",") if p.strip()]
    shown = f"({', '.join(actual[:SHOWN_PARAMETERS])}{', …' if len(actual) > SHOWN_PARAMETERS else ''})"
    if "..." not in parts:
        return None if actual == parts else f"signature {shown}, expected ({expected})"
    cut = parts.index("...")
    leading, anywhere = parts[:cut], parts[cut + 1:]
    if actual[: len(leading)] != leading:
        return f"signature {shown} does not start ({', '.join(leading)})"
    missing = [name for name in anywhere if name not in actual]
    return f"signature {shown} lacks {', '.join(missing)}" if missing else None


# ---------------------------------------------------------------- judging one entry on one tree


@dataclass
class Cell:
    status: str
    reason: str = ""


def resolve(tree: SourceTree, entry: VllmName) -> tuple[Found | None, set[str] | None, str]:
    """(where ``entry`` is defined, the members when its owner is a dict or Literal, why not found)."""
    module, _, inner = entry.owner.partition(":")
    if tree.module_file(module) is None:
        return None, None, f"no module {module}"
    owner = tree.lookup(module, inner) if inner else Found(module, "module")
    if owner is None:
        return None, None, f"no {inner} in {module}"
    if not entry.name:
        return owner, None, ""
    if owner.kind == "class":
        found = tree.member(owner, entry.name)
        return found, None, "" if found else f"{inner} has no {entry.name} (nor its vLLM base classes)"
    if owner.kind == "value":
        return owner, tree.members_of_value(owner), ""
    if owner.kind == "module":
        found = tree.lookup(owner.module, entry.name)
        return found, None, "" if found else f"no {entry.name} in {owner.module}"
    return None, None, f"{entry.owner} is {owner.kind}: its members cannot be read"


def judge(tree: SourceTree, entry: VllmName) -> Cell:
    """The cell of ``entry`` on one source tree (its applicability is decided by the caller): on
    its owner, then on each class vLLM instantiates in its place (``used_as``)."""
    if entry.not_checked:
        return Cell(NOT_APPLICABLE, entry.not_checked)
    if entry.set_by:
        return set_as_vllm_sets(tree, entry)
    for owner in (entry.owner, *entry.used_as):
        cell = judge_name(tree, replace(entry, owner=owner, used_as=()))
        if cell.status != OK:
            return cell if owner == entry.owner else Cell(cell.status, f"on {owner}: {cell.reason}")
    return Cell(OK)


def set_as_vllm_sets(tree: SourceTree, entry: VllmName) -> Cell:
    """``entry.set_by``, a method of vLLM's, assigns an attribute ``entry.name`` (of any object:
    the config its model holds) as the plugin's code does."""
    owner, _, method = entry.set_by.rpartition(".")
    found, _, reason = resolve(tree, VllmName(owner, method, ""))
    if found is None or found.kind != "function":
        return Cell(BROKEN, reason or f"{entry.set_by} is a {found.kind}, not a method")
    stored = {n.attr for n in ast.walk(found.node) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)}
    if entry.name in stored:
        return Cell(OK)
    return Cell(BROKEN, f"vLLM's {entry.set_by.rpartition(':')[2]} no longer sets {entry.name}, which the plugin "
                        "sets as it did")


def judge_name(tree: SourceTree, entry: VllmName) -> Cell:
    """``entry`` on its own owner: present (or absent, as it asks), with its signature, reaching
    the subclasses it names, setting no more than it lists."""
    if entry.kind == "text":
        present = tree.holds_text(entry.owner, entry.name)
        reason = "" if present or tree.module_file(entry.owner) else f"no module {entry.owner}"
        return _presence(entry, present, reason or f"no string {entry.name!r} in {entry.owner}")
    found, members, reason = resolve(tree, entry)
    if members is not None:
        return _presence(entry, entry.name in members, f"{entry.name!r} is not among {entry.owner}'s")
    if found is None or entry.absent:
        return _presence(entry, found is not None, reason)
    if entry.signature is not None:
        actual = tree.signature(found)
        if actual is None:
            return Cell(BROKEN, f"{entry.label} is a {found.kind}, not a callable")
        problem = signature_problem(entry.signature, actual)
        if problem:
            return Cell(BROKEN, problem)
    missed = [why for cls in entry.reaches if (why := unreached(tree, found, cls, entry.name))]
    if missed:
        return Cell(BROKEN, "; ".join(missed))
    if entry.sets and found.kind == "function":
        extra = sorted(attributes_set(found.node) - set(entry.sets))
        if extra:
            return Cell(BROKEN, f"vLLM's {entry.label} also sets {', '.join(extra)}, which the plugin's "
                                "subclass does not")
    return Cell(OK)


def _presence(entry: VllmName, present: bool, reason: str) -> Cell:
    if entry.absent:
        return Cell(BROKEN, f"vLLM has {entry.name!r} itself") if present else Cell(OK)
    if present:
        return Cell(OK)
    return Cell(ABSENT, f"{reason} ({entry.optional})") if entry.optional else Cell(BROKEN, reason)


def unreached(tree: SourceTree, patched: Found, subclass: str, name: str) -> str | None:
    """Why a replacement of ``name`` at ``patched`` misses ``subclass``, or None where the
    subclass inherits it or its own ``name`` calls ``super().name``."""
    module, _, cls = subclass.partition(":")
    owner = tree.lookup(module, cls)
    if owner is None or owner.kind != "class":
        return f"no class {subclass}"
    own = tree.member(owner, name)
    if own is None or own.owner == patched.owner:
        return None if own else f"{cls} has no {name}"
    calls_super = any(isinstance(n, ast.Attribute) and n.attr == name and isinstance(n.value, ast.Call)
                      and ast.unparse(n.value.func) == "super" for n in ast.walk(own.node))
    return None if calls_super else f"{cls} overrides {name} without calling super(): the replacement misses it"


def condition_met(tree: SourceTree, condition: str) -> bool:
    """``applies_if``: ``module:Class.attribute`` exists (``!`` first: does not)."""
    negate = condition.startswith("!")
    owner, _, name = condition.lstrip("!").rpartition(".")
    found, _, _ = resolve(tree, VllmName(owner, name, ""))
    return (found is not None) != negate


# ---------------------------------------------------------------- the rows


@dataclass
class Row:
    label: str
    source: str  # "PATCHES", "REFUSAL" or "READ"
    entry: VllmName | None  # None: a row of PATCHES without a check (vllm_names.expected)
    why: str = ""
    patch: Patch | None = None  # the row of PATCHES or REFUSAL; None for READ
    cells: dict[str, Cell] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        return self.patch.kind if self.patch else ""


def rows() -> list[Row]:
    """One row per patch (its check from ``vllm_names.expected``) and per READ entry."""
    patches = PATCHES if REFUSAL in PATCHES else (*PATCHES, REFUSAL)
    result = []
    for patch in patches:
        entry = expected(patch)
        source = "REFUSAL" if patch is REFUSAL else "PATCHES"
        result.append(Row(entry.label if entry else patch.name, source, entry, patch.why, patch))
    used = {(patch.owner, patch.attribute) for patch in patches}
    stale = [f"{e.owner}.{e.name}" for e in PATCHED if (e.owner, e.name) not in used]
    if stale:
        raise SystemExit(f"check_vllm_range: vllm_names.PATCHED has entries no patch uses: {', '.join(stale)}")
    return result + [Row(entry.label, "READ", entry, entry.used_by) for entry in READ]


def fill(row: Row, version: str, tree: SourceTree) -> None:
    row.cells[version] = cell_of(row, version, tree)


def cell_of(row: Row, version: str, tree: SourceTree) -> Cell:
    """A row's cell on one release: n/a where the row does not apply there, broken where its
    ``versions`` and the plugin's own run-time condition (``applies_if``) disagree."""
    if row.entry is None:
        return Cell(BROKEN, "no check: record the expected shape in vllm_edsd/serving/vllm_names.py PATCHED")
    if row.source != "REFUSAL" and not version_supported(version):
        return Cell(NOT_APPLICABLE, "outside SUPPORTED_VLLM: the plugin refuses \"edsd\"")
    claimed = row.patch is None or row.source == "REFUSAL" or row.patch.claims(version)
    condition = row.entry.applies_if
    if condition and condition_met(tree, condition) != claimed:
        if claimed:
            return Cell(BROKEN, f"the row's versions ({row.patch.versions}) include {version}, where the plugin "
                                f"does not make it ({condition} does not hold)")
        return Cell(BROKEN, f"the plugin makes it in {version} ({condition} holds), which the row's versions "
                            f"({row.patch.versions}) leave out")
    if not claimed:
        return Cell(NOT_APPLICABLE, f"the row's versions: {row.patch.versions}")
    return judge(tree, row.entry)


# ---------------------------------------------------------------- output


METHODS = "vllm.config.speculative:SpeculativeMethod"


def speculative_methods(tree: SourceTree) -> set[str]:
    """The ``"method"`` values a release's ``SpeculativeConfig`` accepts."""
    found, _, _ = resolve(tree, VllmName(METHODS, "", ""))
    return tree.members_of_value(found) if found is not None and found.kind == "value" else set()


def method_changes(methods: dict[str, set[str]]) -> list[str]:
    """A line per release whose speculative methods differ from the release before it."""
    lines, before = [], None
    for version, now in methods.items():
        if before is None:
            lines.append(f"- {version}: {', '.join(sorted(now))}")
        elif now != before:
            changes = [f"+{m}" for m in sorted(now - before)] + [f"−{m}" for m in sorted(before - now)]
            lines.append(f"- {version}: {', '.join(changes)}")
        before = now
    return lines


def render(table: list[Row], versions: list[str], methods: dict[str, set[str]]) -> str:
    lo, hi = SUPPORTED_VLLM
    lines = [
        "# vLLM names vllm-edsd depends on, release by release",
        "",
        "Written by `python scripts/check_vllm_range.py`, which reads each release's source distribution "
        "from PyPI (no GPU, no import). Rows: `PATCHES` and `REFUSAL` of `vllm_edsd/serving/patches.py` (with "
        "each row's kind, checked as the kind calls for), then `READ` of `vllm_edsd/serving/vllm_names.py`, "
        "where each row's expected shape is recorded. "
        f"`SUPPORTED_VLLM` is [{lo[0]}.{lo[1]}, {hi[0]}.{hi[1]}).",
        "",
        f"{OK} present with the expected shape · {BROKEN} broken (reasons below) · {ABSENT} absent, optional "
        f"(the plugin goes without it) · {NOT_APPLICABLE} the row does not apply to that release",
        "",
        "| row | " + " | ".join(versions) + " |",
        "|---|" + "---|" * len(versions),
    ]
    for row in table:
        source = f"{row.source} ({row.kind})" if row.kind else row.source
        lines.append(f"| {source}: `{row.label}` | " + " | ".join(row.cells[v].status for v in versions) + " |")
    for title, status in (("Broken", BROKEN), ("Absent (optional)", ABSENT)):
        notes = [f"- {v} `{row.label}`: {row.cells[v].reason}" for row in table for v in versions
                 if row.cells[v].status == status]
        lines += ["", f"## {title}", "", *(notes or ["none"])]
    lines += ["", "## Not applicable in a supported release", "", *(not_applicable(table, versions) or ["none"])]
    lines += ["", "## vLLM's speculative methods", "",
              f"`{METHODS}`, in the first release read and then as it changes (the plugin translates "
              "`\"edsd\"` alone, to `\"eagle3\"`):", "", *method_changes(methods)]
    return "\n".join(lines) + "\n"


def not_applicable(table: list[Row], versions: list[str]) -> list[str]:
    """A line per row and reason for its n/a cells in supported releases: the releases its
    ``versions`` leave out, or why vLLM has nothing to check."""
    lines = []
    for row in table:
        by_reason: dict[str, list[str]] = {}
        for v in versions:
            if row.cells[v].status == NOT_APPLICABLE and version_supported(v):
                by_reason.setdefault(row.cells[v].reason, []).append(v)
        lines += [f"- `{row.label}` ({row.kind or row.source}) in {', '.join(vs)}: {reason}"
                  for reason, vs in by_reason.items()]
    return lines


def as_json(table: list[Row], versions: list[str]) -> dict:
    """The table as data: each row's cells, and a reason for every cell that is not a plain ✓."""
    return {
        "releases": versions,
        "supported_vllm": [list(bound) for bound in SUPPORTED_VLLM],
        "rows": [{"label": row.label, "source": row.source, "kind": row.kind or None, "why": row.why,
                  "owner": row.entry.owner if row.entry else None, "name": row.entry.name if row.entry else None,
                  "cells": {v: row.cells[v].status for v in versions},
                  "reasons": {v: row.cells[v].reason for v in versions if row.cells[v].reason}}
                 for row in table],
    }


def broken(table: list[Row]) -> int:
    return sum(cell.status == BROKEN for row in table for cell in row.cells.values())


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="check_vllm_range.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Rows, expected signatures and when each row applies: vllm_edsd/serving/vllm_names.py. "
               "A release that breaks a row: fix the plugin there if small, else narrow SUPPORTED_VLLM "
               "in vllm_edsd/serving/versions.py (and the README's support matrix).")
    parser.add_argument("--releases", type=lambda s: [v.strip() for v in s.split(",") if v.strip()],
                        help="comma-separated vLLM versions (default: the newest patch of each minor 0.24-0.33)")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE,
                        help=f"where sdists are downloaded and unpacked (default: {DEFAULT_CACHE})")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="where report.md and results.json are written (default: bench/results/vllm-range)")
    parser.add_argument("--offline", action="store_true",
                        help="do not ask PyPI: use the cached release list and sdists")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        releases = releases_from_listing(read_listing(args.cache, args.offline), args.releases)
        print(f"vLLM releases: {', '.join(r.version for r in releases)}", flush=True)
        trees = {r.version: SourceTree(unpack(r, args.cache)) for r in releases}
    except UNREACHABLE as exc:
        print(f"check_vllm_range: cannot get the vLLM sources: {exc}", file=sys.stderr)
        return 2
    table = rows()
    for version, tree in trees.items():
        for row in table:
            fill(row, version, tree)
    versions = list(trees)
    report = render(table, versions, {v: speculative_methods(tree) for v, tree in trees.items()})
    print(report)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "report.md").write_text(report, encoding="utf-8")
    (args.out / "results.json").write_text(json.dumps(as_json(table, versions), indent=1, ensure_ascii=False) + "\n",
                                           encoding="utf-8")
    count = broken(table)
    print(f"{count} broken cell(s); written to {args.out}", flush=True)
    return 1 if count else 0


if __name__ == "__main__":
    sys.exit(main())
