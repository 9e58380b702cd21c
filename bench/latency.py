"""The latency suite: vLLM's OpenAI-compatible server per method on 127.0.0.1, driven by
locust (headless, in its own process) with open-loop Poisson arrivals at fixed request rates.

Open loop: the arrival times are drawn before the run (seeded, the same for every method), and
a request is sent at its time whether or not earlier ones have finished, so the offered load is
the requested rate and not whatever the server sustains. The locustfile writes every request's
raw timings to a JSON-lines file; the statistics here are computed from those raw values.

Traffic goes only to the loopback server this suite starts; each rate sends a bounded number of
requests under a hard time limit, and the server is stopped afterwards, also on errors and
interrupts.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
from tqdm import tqdm

from vllm_edsd.errors import EDSDError
from vllm_edsd.launch.server import default_dtype, running_server

from .offline import Setup, method_config, prompt_pool

LOCUSTFILE = Path(__file__).with_name("locustfile.py")
SEED = 0
START_LEAD_S = 2.0  # all locust users are spawned (within 1 s) before the first arrival
DRAIN_S = 120.0  # per-request read timeout, and how long the run may go on after the last arrival
LATE_S = 0.05  # a request sent later than this after its scheduled time counts as a late start
NOT_COMPLETED = "not completed within the time limit"


def poisson_schedule(qps: float, num_requests: int, seed: int = SEED) -> list[float]:
    """Arrival times (s from the start) of a Poisson process: exponential gaps with mean 1/qps.

    Seeded so that every method is measured on the same arrivals.
    """
    return np.cumsum(np.random.default_rng(seed).exponential(1 / qps, num_requests)).tolist()


def summary(values: list[float], name: str) -> dict[str, float | None]:
    """``{name}_mean_s``, ``_p50_s`` and ``_p99_s`` of raw per-request values (None if empty)."""
    if not values:
        return {f"{name}_{stat}_s": None for stat in ("mean", "p50", "p99")}
    p50, p99 = np.percentile(np.asarray(values, dtype=float), [50, 99])
    return {f"{name}_mean_s": float(np.mean(values)), f"{name}_p50_s": float(p50), f"{name}_p99_s": float(p99)}


def ttft(record: dict) -> float | None:
    """Time from sending to the first chunk that carries output tokens."""
    return record["chunks"][0][0] if record["chunks"] else None


def itl(record: dict) -> float | None:
    """Mean inter-token latency of one request: time from the first to the last token-bearing
    chunk over the tokens that came after the first chunk (several per chunk when drafts are
    accepted)."""
    if not record["chunks"]:
        return None
    (first_t, first_n), last_t = record["chunks"][0], record["chunks"][-1][0]
    later_tokens = record["output_tokens"] - first_n
    return (last_t - first_t) / later_tokens if later_tokens > 0 else None


def aggregate(records: list[dict], scheduled: int) -> dict:
    """One result row's numbers from the raw records of a run that scheduled ``scheduled`` requests;
    scheduled requests without a record count as failures."""
    ok = [r for r in records if r["error"] is None]
    reasons = Counter(r["error"] for r in records if r["error"] is not None)
    if len(records) < scheduled:
        reasons[NOT_COMPLETED] = scheduled - len(records)
    starts = sorted(r["start_s"] for r in records)
    window = max((r["start_s"] + r["e2e_s"] for r in ok), default=0.0) - (starts[0] if starts else 0.0)
    tokens = sum(r["output_tokens"] for r in ok)
    return {
        "num_requests": scheduled,
        "failures": sum(reasons.values()),
        "failure_reasons": dict(reasons),
        "late_starts": sum(r["start_s"] - r["scheduled_s"] > LATE_S for r in records),
        "achieved_qps": (len(starts) - 1) / (starts[-1] - starts[0])
        if len(starts) > 1 and starts[-1] > starts[0]
        else None,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / window if window > 0 else None,
        **summary([r["e2e_s"] for r in ok], "e2e"),
        **summary([v for v in map(ttft, ok) if v is not None], "ttft"),
        **summary([v for v in map(itl, ok) if v is not None], "itl"),
    }


def read_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []


def run_locust(base: str, messages: list[list[dict]], arrivals: list[float], max_tokens: int, max_users: int,
               workdir: Path, name: str, drain_s: float = DRAIN_S, ignore_eos: bool = True) -> list[dict]:
    """Send ``messages[i]`` at ``arrivals[i]`` (open loop) with locust in its own process; the
    raw record of every request that ended (see the locustfile), in no particular order.
    ``drain_s``: how long the run may go on after the last arrival (an overloaded server has a
    backlog to serve then)."""
    plan = {"arrivals_s": arrivals, "messages": messages, "max_tokens": max_tokens, "ignore_eos": ignore_eos}
    users = min(len(arrivals), max_users)
    return run_plan(base, plan, users, arrivals[-1] + drain_s, workdir, name)


def run_plan(base: str, plan: dict, users: int, last_s: float, workdir: Path, name: str) -> list[dict]:
    """Run one locustfile plan (see its docstring) with ``users`` users in a locust process of
    its own, killed ``last_s`` seconds after the first arrival at the latest; the raw record of
    every request that ended, in no particular order."""
    plan = {"start_lead_s": START_LEAD_S, "request_timeout_s": DRAIN_S, **plan}
    plan_file, records_file, log_file = (workdir / f"{name}.{ext}" for ext in ("plan.json", "jsonl", "locust.log"))
    plan_file.write_text(json.dumps(plan))
    records_file.unlink(missing_ok=True)
    run_time = math.ceil(START_LEAD_S + 1 + last_s)  # hard limit; normally the last request ends it
    env = {**os.environ, "EDSD_BENCH_PLAN": str(plan_file), "EDSD_BENCH_RECORDS": str(records_file)}
    cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--host", base,
           "-u", str(users), "-r", str(users), "--run-time", f"{run_time}s", "--only-summary",
           "--exit-code-on-error", "0"]
    with open(log_file, "w") as log:
        proc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=run_time + 120)
    if proc.returncode != 0:
        raise EDSDError(f"locust exited with status {proc.returncode}:\n{log_file.read_text()[-4000:]}")
    return read_records(records_file)


def run_rate(base: str, prompts: list[list[dict]], qps: float, num_requests: int, max_users: int, max_tokens: int,
             workdir: Path, ignore_eos: bool = True) -> dict:
    """One locust run of ``num_requests`` Poisson arrivals at ``qps``; the row's latency numbers."""
    messages = [prompts[i % len(prompts)] for i in range(num_requests)]
    records = run_locust(
        base, messages, poisson_schedule(qps, num_requests), max_tokens, max_users, workdir, f"qps{qps}",
        ignore_eos=ignore_eos,
    )
    return {"qps": qps, "users": min(num_requests, max_users), **aggregate(records, num_requests)}


def warm_up(base: str) -> None:
    """One short request, so that the first measured request does not pay for first-use costs."""
    import requests

    body = {"model": "bench", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
    requests.post(f"{base}/v1/chat/completions", json=body, timeout=DRAIN_S).raise_for_status()


def latency(setup: Setup, rates: list[float], num_requests: int, max_users: int) -> list[dict]:
    """Latency rows per (method, K) and request rate, all methods on the same seeded arrivals."""
    prompts, dtype = prompt_pool(setup), setup.dtype or default_dtype()
    server_args = ["--served-model-name", "bench", "--dtype", dtype]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for method, k in tqdm(setup.methods_with_k(), desc="latency", unit="server"):
            workdir = Path(tmp) / f"{method}-k{k}"
            workdir.mkdir()
            spec = method_config(setup, method, k)
            with running_server(setup.target, spec, extra_args=server_args, log_path=workdir / "server.log",
                                eager=setup.eager) as base:
                warm_up(base)
                for qps in rates:
                    result = run_rate(base, prompts, qps, num_requests, max_users, setup.max_tokens, workdir,
                                      setup.ignore_eos)
                    rows.append({"suite": "latency", "method": method, "k": k, "temperature": 0.0,
                                 "dtype": dtype, **result})
    return rows
