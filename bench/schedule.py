"""``python -m bench schedule``: the K-by-batch-size schedule that maximises this machine's
throughput with one drafter, measured, then served and measured again.

For every batch size (default 1, 4, 16, 64) it times the target alone, the drafter at K=0
(vLLM's table with K 0: the drafter's first forward still runs, its vocabulary head does not),
each static K, and the K=1 engine with every request capped at 0 (the drafter skipped
entirely: what a K=0 step costs at best, vLLM's own speculative bookkeeping included), picks the
fastest K per batch size, and writes vLLM's
``num_speculative_tokens_per_batch_size`` table for it: DIR/schedule.json, ready for
``--speculative-config``. An engine serving that table is then timed beside the rest, so the
report compares the schedule with static K and with no speculation at every batch size.
Greedy (T=0), every reply ``--max-tokens`` long; DIR/results.json and DIR/report.md.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from tqdm import tqdm

from vllm_edsd.errors import EDSDError
from vllm_edsd.launch.engine import llm_session, speculative_config
from vllm_edsd.serving.features.draft_length import REQUEST_KEY

from .arguments import numbers, target_and_drafter
from .machine import describe, machine
from .offline import CATEGORIES, generate, load_prompts

MIN_REQUESTS = 8  # small batches run several rounds, so one prompt does not decide a batch size
SUITE = "schedule"
NONE, SCHEDULE = "none", "schedule"
OPTED_OUT = "opted-out"  # the K=1 engine, every request capped at 0 (extra_args): the drafter never runs


def choose_schedule(tok_s: dict[int, dict[int, float]], max_batch: int) -> list[list[int]]:
    """vLLM's ``num_speculative_tokens_per_batch_size`` ranges from measured throughput:
    ``tok_s[batch][k]``. Each measured batch size gets its fastest K, and holds it up to the
    geometric mean of it and the next measured size; neighbours with the same K merge."""
    if not tok_s:
        raise EDSDError("no throughput measured: nothing to choose a schedule from")
    sizes = sorted(tok_s)
    best = [max(tok_s[b], key=lambda k: (tok_s[b][k], -k)) for b in sizes]  # ties: the smaller K
    ends = [math.isqrt(a * b) for a, b in zip(sizes, sizes[1:])] + [max(max_batch, sizes[-1])]
    ranges: list[list[int]] = []
    start = 1
    for k, end in zip(best, ends):
        if ranges and ranges[-1][2] == k:
            ranges[-1][1] = end
        else:
            ranges.append([start, end, k])
        start = end + 1
    return ranges


def static_k_throughput(runs: list[dict]) -> dict[int, dict[int, float]]:
    """``tok_s[batch][k]`` of the static-K engines (K=0 included), the only ones a table can
    serve: none and the opted-out rows are references, never choices."""
    tok_s: dict[int, dict[int, float]] = {}
    for r in runs:
        if isinstance(r["engine"], int):
            tok_s.setdefault(r["batch_size"], {})[r["engine"]] = r["output_tokens_per_s"]
    return tok_s


def schedule_config(ranges: list[list[int]]) -> dict:
    """The speculative-config keys that serve ``ranges``: vLLM caps every K at
    ``num_speculative_tokens`` and needs that to be at least 1."""
    return {"num_speculative_tokens": max(1, max(k for _, _, k in ranges)),
            "num_speculative_tokens_per_batch_size": ranges}


def engine_config(args: argparse.Namespace, label: str | int, ranges: list[list[int]] | None = None) -> dict | None:
    """The speculative config of one timed engine: none, the schedule, or static K (K=0 is vLLM's
    table with one range of K 0; the K=1 engine also times the opted-out requests)."""
    if label == NONE:
        return None
    if label == SCHEDULE:
        keys = schedule_config(ranges)
        return speculative_config(args.method, args.drafter, keys.pop("num_speculative_tokens"), **keys)
    if label == 0:
        return speculative_config(args.method, args.drafter, 1, num_speculative_tokens_per_batch_size=[[1, 1, 0]])
    return speculative_config(args.method, args.drafter, label)


def time_batches(llm, prompts: list[list[dict]], batch_sizes: list[int], max_tokens: int,
                 extra_args: dict | None = None) -> dict[int, dict]:
    """Output tokens/s at each batch size: ``max(batch, MIN_REQUESTS)`` requests, ``batch`` at a
    time, every reply ``max_tokens`` long, each request with ``extra_args``."""
    generate(llm, prompts[:1], 0.0, 8, one_at_a_time=False)  # one-time costs, before any timing
    timed = {}
    for batch in batch_sizes:
        requests = [prompts[i % len(prompts)] for i in range(max(batch, MIN_REQUESTS))]
        rounds = [generate(llm, requests[i:i + batch], 0.0, max_tokens, one_at_a_time=False, extra_args=extra_args)
                  for i in range(0, len(requests), batch)]
        total = {key: sum(r[key] for r in rounds) for key in ("output_tokens", "elapsed_s", "drafts", "draft_tokens")}
        timed[batch] = {**total, "output_tokens_per_s": total["output_tokens"] / total["elapsed_s"],
                        "mean_draft_length": total["draft_tokens"] / total["drafts"] if total["drafts"] else 0.0,
                        "dtype": rounds[0]["dtype"]}
    return timed


def measure(args: argparse.Namespace, prompts: list[list[dict]], label: str | int,
            ranges: list[list[int]] | None = None) -> list[dict]:
    """The rows of one engine: ``label``'s and, on the K=1 engine (the opted-out requests' own
    config), the same engine timed again with every request capped at 0."""
    engine_kwargs = ({"max_num_seqs": max(args.batch_sizes), "enforce_eager": args.eager}
                     | ({"dtype": args.dtype} if args.dtype else {}))
    timings = [(label, None)] + ([(OPTED_OUT, {REQUEST_KEY: 0})] if label == 1 else [])
    rows = []
    with llm_session(args.target, engine_config(args, label, ranges), **engine_kwargs) as llm:
        for timed_label, extra_args in timings:
            timed = time_batches(llm, prompts, args.batch_sizes, args.max_tokens, extra_args)
            rows += [{"engine": timed_label, "batch_size": b, **row} for b, row in timed.items()]
    return rows


def _cell(tok_s: float | None, base: float | None) -> str:
    if tok_s is None:
        return "-"
    return f"{tok_s:.1f}" + (f" ({tok_s / base:.2f}x)" if base else "")


def render(results: dict) -> str:
    """The report: tok/s per batch size (rows) and engine (columns), then the table chosen."""
    runs, machine = results["runs"], results["machine"]
    labels = list(dict.fromkeys(r["engine"] for r in runs))
    cell = {(r["engine"], r["batch_size"]): r["output_tokens_per_s"] for r in runs}
    names = {NONE: "none", SCHEDULE: "schedule", OPTED_OUT: "every request capped at 0", 0: "K=0"}
    names |= {k: f"K={k}" for k in labels if isinstance(k, int) and k}
    lines = [f"# K by batch size: {results['method']} on {results['target']}", "",
             f"Command: `{results['command']}`  ",
             f"Machine: {describe(machine)}; "
             f"dtype {runs[0]['dtype'] if runs else '?'}{'; engines eager' if results.get('eager') else ''}; "
             f"T=0, {results['max_tokens']} tokens per reply.", "",
             "Output tokens/s; in brackets, against none.", "",
             "| batch | " + " | ".join(names[label] for label in labels) + " |",
             "|---" * (len(labels) + 1) + "|"]
    for batch in sorted({r["batch_size"] for r in runs}):
        base = cell.get((NONE, batch))
        cells = [_cell(cell.get((label, batch)), None if label == NONE else base) for label in labels]
        lines.append(f"| {batch} | " + " | ".join(cells) + " |")
    if results.get("schedule"):
        lines += ["", "Schedule (batch sizes from, to, K), in DIR/schedule.json:", "",
                  f"`{json.dumps(results['schedule'])}`"]
    return "\n".join(lines) + "\n"


def checked(args: argparse.Namespace) -> argparse.Namespace:
    """The arguments with --quick's sizes applied and the batch sizes read; a count below 1 is
    refused in one line naming its flag."""
    if args.quick:
        args.batch_sizes, args.max_k, args.max_tokens, args.eager = "1,4", min(args.max_k, 2), 16, True
    args.batch_sizes = sorted(set(numbers("--batch-sizes", args.batch_sizes, int, 1)))
    for flag in ("max_k", "max_tokens", "max_batch"):
        if getattr(args, flag) < 1:
            raise EDSDError(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    return args


def run(args: argparse.Namespace) -> int:
    """Time none and every static K (K=1 also opted out), choose the table, serve it and time it."""
    args = checked(args)
    args.target, args.drafter = target_and_drafter(args.target, args.method, args.drafter)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = [c for category in CATEGORIES for c in load_prompts(category, 4)]
    results = {"machine": machine(), "method": args.method, "target": args.target, "drafter": args.drafter,
               "max_tokens": args.max_tokens, "command": args.command, "eager": args.eager, "runs": [],
               "schedule": None}

    def record(label: str | int, ranges: list[list[int]] | None = None) -> None:
        results["runs"] += measure(args, prompts, label, ranges)
        (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
        (out / "report.md").write_text(render(results))

    # An engine that cannot start raises EDSDError: what was measured stays in results.json.
    for label in tqdm((NONE, *range(args.max_k + 1)), desc="bench schedule", unit="engine"):
        record(label)
    results["schedule"] = schedule_config(choose_schedule(static_k_throughput(results["runs"]), args.max_batch))
    (out / "schedule.json").write_text(json.dumps(results["schedule"]) + "\n")
    record(SCHEDULE, results["schedule"]["num_speculative_tokens_per_batch_size"])
    print(render(results))
    print(f"wrote {out / 'schedule.json'}, {out / 'results.json'} and {out / 'report.md'}")
    return 0
