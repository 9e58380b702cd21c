"""The soak suite's ``report.md``, rendered from its ``results.json`` alone."""

from __future__ import annotations

from collections import Counter

from .machine import describe
from .report import _fmt, _table


def _outcomes(results: dict) -> list[str]:
    """Requests per outcome, per concurrency level and over the whole run."""
    names = sorted({name for level in results["levels"].values() for name in level["outcomes"]})
    rows = [[str(users), str(level["requests"]), _fmt(level["wall_s"], ".0f"),
             *(str(level["outcomes"].get(name, 0)) for name in names)] for users, level in results["levels"].items()]
    rows.append(["all", str(sum(level["requests"] for level in results["levels"].values())), "",
                 *(str(results["overall"]["outcomes"].get(name, 0)) for name in names)])
    return ["## Requests per outcome", "", _table(["users", "requests", "wall s", *names], rows)]


def _bad_requests(results: dict) -> list[str]:
    """Each kind of bad request's outcomes."""
    bad = results["overall"]["bad_requests"]
    rows = [[what, ", ".join(f"{name}: {count}" for name, count in counts.items())] for what, counts in bad.items()]
    return ["## Bad requests", "", "Each must get a 4xx whose error names the field.", "",
            _table(["request", "outcomes"], rows)]


def _faults(results: dict) -> list[str]:
    """Every fault, as sent and answered (the first 50)."""
    overall = results["overall"]
    if not overall["fault_count"]:
        return ["## Faults", "", "None: no 5xx, every bad request refused naming its field, no good request failed."]
    lines = ["## Faults", "", f"{overall['fault_count']} in all; the first {len(overall['faults'])}:", ""]
    return lines + [f"- {f['outcome']}: {f['what']}, HTTP {f['status']}, {f['error']}: `{f['error_body']}`"
                    for f in overall["faults"]]


def _greedy(results: dict) -> list[str]:
    """Greedy replies under load against the same requests sent alone."""
    greedy = results["greedy"]
    lines = ["## Greedy replies under load", "",
             f"{greedy['equal']} of {greedy['compared']} equal to the same prompt's reply sent alone to the same "
             f"server ({_fmt(greedy['equal_share'], '.1%')})."]
    parted = Counter((d["prompt"], d["first_difference_at"]) for d in greedy["differ"])
    lines += [f"- prompt {prompt}: {count} repl{'y parts' if count == 1 else 'ies part'} at token {token}"
              for (prompt, token), count in sorted(parted.items())]
    if parted and results.get("dtype") in ("bfloat16", "float16"):
        lines += ["", f"In {results['dtype']}, vLLM's own greedy reply can depend on the batch: a step of one token "
                  "alone is rounded otherwise than the same token in a larger batch, and a near-tie parts "
                  "(`python scripts/batch_variance.py` shows it without speculation). float32 compares exactly."]
    return lines


def _server(results: dict) -> list[str]:
    """Memory, the log while serving, the state after the load and the shutdown."""
    state, shutdown = results["state_after_load"], results.get("shutdown") or {}
    lines = ["## The server", ""]
    samples = results["memory_samples"]
    if samples:
        totals = [sum(sizes.values()) for _, sizes in samples]
        lines.append(f"Resident memory of its processes (memory.png): {totals[0]:.0f} MiB at the start, "
                     f"{max(totals):.0f} MiB at most, {totals[-1]:.0f} MiB at the end ({len(samples)} samples).")
        growth = results.get("memory_growth")
        if growth:
            lines.append(f"From the 5th minute ({growth['from_s']:.0f} s, {growth['from_mib']} MiB) to the end "
                         f"({growth['end_mib']} MiB): {growth['growth_percent']:+.1f} %.")
    else:
        lines.append("Resident memory: not watched (pass --pid with --url).")
    problems = results["serving_log_problems"]
    lines.append(f"Log lines with an exception while serving: {len(problems)}.")
    lines += [f"- `{line}`" for line in problems[:20]]
    lines.append(f"After the load: {state}.")
    if shutdown:
        gone = f"{shutdown['gone_s']} s" if shutdown["gone_s"] is not None else f"not within {shutdown['limit_s']} s"
        lines.append(f"SIGTERM (--shutdown-timeout {results['shutdown_timeout']}): {shutdown['processes']} processes, "
                     f"the last gone after {gone}; left: {shutdown['left'] or 'none'}; exception lines in the log on "
                     f"the way out: {len(shutdown['log_problems'])}.")
        lines += [f"- `{line}`" for line in shutdown["log_problems"][:20]]
    return lines


def _offline(results: dict) -> list[str]:
    """The offline variant's findings, where it ran."""
    offline = results.get("offline")
    if not offline:
        return []
    return ["## Offline: requests aborted mid-generation", "", *offline["summary"]]


def _serving(results: dict) -> str:
    """The started server's dtype and parallelism, where the results say them."""
    parts = [results["dtype"]] if results.get("dtype") else []
    parts += [f"{name} {results[key]}" for name, key in (("TP", "tensor_parallel_size"), ("DP", "data_parallel_size"))
              if results.get(key, 1) > 1]
    return f" ({', '.join(parts)})" if parts else ""


def render(results: dict) -> str:
    """The whole report: verdict first, then each section."""
    broken = results["broken_rules"]
    lines = ["# Soak", "", f"Command: `{results['command']}`  ",
             f"Machine: {describe(results['machine'])}; server: {results['server']}{_serving(results)}; "
             f"K={results['k']}, {results['max_tokens']} tokens per reply, concurrency {results['concurrency']}, "
             f"{results['duration_s']} s.", "",
             "**Verdict:** " + ("held: no rule broke." if not broken else "broke: " + "; ".join(broken)), "",
             "A round: " + "; ".join(results["round"]) + ".", ""]
    for section in (_outcomes, _bad_requests, _faults, _greedy, _server, _offline):
        lines += [*section(results), ""]
    return "\n".join(lines)
