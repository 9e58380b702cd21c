"""The bench report read back as tables, and checked against the results it came from.

Independent of ``bench.report``: the report's markdown is parsed here, and each row's cells
are compared with the numbers of its run in results.json, within the rounding the report
shows. A report that drops, reorders or mislabels rows, or prints another run's number in a
column, fails the check.
"""

from __future__ import annotations

DASH = "–"  # what the report prints where a value is missing


def report_tables(report: str) -> dict[str, list[dict[str, str]]]:
    """The first markdown table of each ``## `` section, keyed by the heading's first word
    ("Acceptance", "Throughput"...), as rows of {column: cell}."""
    tables = {}
    for section in report.split("\n## ")[1:]:
        lines = [line for line in section.splitlines() if line.startswith("|")]
        if not lines:
            continue
        header = _cells(lines[0])
        separators = [i for i, line in enumerate(lines) if set(line.strip()) <= {"|", "-"}]
        body = lines[2 : separators[1] - 1] if len(separators) > 1 else lines[2:]  # up to a second table
        tables[section.split()[0].rstrip(":")] = [dict(zip(header, _cells(line), strict=True)) for line in body]
    return tables


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def shows(cell: str, value: float | None, places: int) -> bool:
    """``cell`` is ``value`` rounded to ``places`` decimals, or the dash where it is None."""
    if value is None:
        return cell == DASH
    return cell != DASH and abs(float(cell) - value) <= 0.51 * 10 ** -places


def shows_list(cell: str, values: list[float], places: int = 2) -> bool:
    """``cell`` is ``values`` rounded, joined by " / " (empty where there are none)."""
    cells = cell.split(" / ") if cell else []
    return len(cells) == len(values) and all(shows(c, v, places) for c, v in zip(cells, values))


# suite -> (the report's section, [(column, the run's key or a function of the run, decimals)]);
# decimals None: the cell is the value's text.
COLUMNS = {
    "acceptance": ("Acceptance", [("method", "method", None), ("K", "k", None), ("category", "category", None),
                                  ("τ", "tau", 2), ("tok/s", "output_tokens_per_s", 1), ("speed-up", "speedup", 2)]),
    "throughput": ("Throughput", [("method", "method", None), ("K", "k", None), ("batch", "batch_size", None),
                                  ("tok/s", "output_tokens_per_s", 1), ("speed-up", "speedup", 2), ("τ", "tau", 2)]),
    "latency": ("Latency", [("method", "method", None), ("requests", "num_requests", None),
                            ("failures", "failures", None), ("e2e mean", "e2e_mean_s", 2), ("e2e p99", "e2e_p99_s", 2),
                            ("TTFT p50", "ttft_p50_s", 3), ("ITL mean", "itl_mean_s", 3),
                            ("tok/s", "output_tokens_per_s", 1)]),
    "robustness": ("Robustness", [("method", "method", None), ("system prompt", "system_prompt", None),
                                  ("τ", "tau", 2)]),
}


def mismatches(report: str, results: dict) -> list[str]:
    """Where the report's tables differ from results.json's runs: one line per difference
    (an empty list: every run is its row, in order, with its values)."""
    tables, found = report_tables(report), []
    for suite, (section, columns) in COLUMNS.items():
        runs = [r for r in results["runs"] if r["suite"] == suite]
        rows = tables.get(section, [])
        if len(rows) != len(runs):
            found.append(f"{section}: {len(rows)} rows for {len(runs)} runs")
            continue
        for i, (row, run) in enumerate(zip(rows, runs)):
            for column, key, places in columns:
                value = run[key]
                ok = row[column] == str(value) if places is None else shows(row[column], value, places)
                if not ok:
                    found.append(f"{section} row {i} {column}: report {row[column]!r}, results {value!r}")
            if suite == "acceptance" and not shows_list(row["acceptance per position"], run["acceptance_per_pos"]):
                found.append(f"{section} row {i}: acceptance per position {row['acceptance per position']!r}, "
                             f"results {run['acceptance_per_pos']}")
    return found + _mixed_mismatches(tables.get("Mixed", []), [r for r in results["runs"] if r["suite"] == "mixed"])


def _mixed_mismatches(rows: list[dict[str, str]], runs: list[dict]) -> list[str]:
    """The mixed-batch table: one row per (method, half), each run's tok/s in its column."""
    found = []
    halves = {(r["method"], r["half"]) for r in runs}
    if len(rows) != len(halves):
        return [f"Mixed: {len(rows)} rows for {len(halves)} halves"]
    for run in runs:
        row = next((row for row in rows if (row["method"], row["half"]) == (run["method"], run["half"])), None)
        cell = None if row is None else row[f"tok/s {run['run']}"]
        if cell is None or not shows(cell, run["output_tokens_per_s"], 1):
            found.append(f"Mixed {run['method']} {run['half']} {run['run']}: report {cell!r}, "
                         f"results {run['output_tokens_per_s']!r}")
    return found
