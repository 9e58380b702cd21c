"""The latency suite: vLLM's OpenAI-compatible server per method on 127.0.0.1, driven by
locust (headless, in its own process) with Poisson arrivals at fixed request rates.

Traffic goes only to the loopback server this suite starts; each rate runs for a bounded
time and the server is stopped afterwards, also on errors and interrupts.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tqdm import tqdm

from vllm_edsd.engine import speculative_config
from vllm_edsd.server import running_server

from .offline import CATEGORIES, Setup, load_prompts

LOCUSTFILE = Path(__file__).with_name("locustfile.py")


def _stats(csv_prefix: Path) -> dict[str, dict]:
    with open(f"{csv_prefix}_stats.csv") as f:
        return {row["Name"]: row for row in csv.DictReader(f)}


def _seconds(row: dict | None, column: str) -> float | None:
    if row is None or row.get(column) in (None, "", "N/A"):
        return None
    return float(row[column]) / 1000


def run_rate(base: str, prompts_file: Path, qps: float, users: int, duration_s: int, max_tokens: int, workdir: Path) -> dict:
    """One locust run at ``qps``; returns latency percentiles in seconds and failure counts."""
    prefix = workdir / f"qps{qps}"
    env = {**os.environ, "EDSD_BENCH_PROMPTS": str(prompts_file), "EDSD_BENCH_QPS": str(qps),
           "EDSD_BENCH_USERS": str(users), "EDSD_BENCH_MAX_TOKENS": str(max_tokens)}
    cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--host", base,
           "-u", str(users), "-r", str(users), "--run-time", f"{duration_s}s", "--stop-timeout", "120",
           "--csv", str(prefix), "--only-summary", "--exit-code-on-error", "0"]
    subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True,
                   timeout=duration_s + 300)
    stats = _stats(prefix)
    chat, e2e, ttft, itl = (stats.get(name) for name in ("chat", "e2e", "ttft", "itl"))
    with open(f"{prefix}_failures.csv") as f:
        reasons = {row["Error"]: int(row["Occurrences"]) for row in csv.DictReader(f)}
    return {
        "qps": qps, "num_requests": int(chat["Request Count"]) if chat else 0,
        "failures": int(chat["Failure Count"]) if chat else 0, "failure_reasons": reasons,
        "latency_mean_s": _seconds(e2e, "Average Response Time"), "latency_p50_s": _seconds(e2e, "50%"),
        "latency_p99_s": _seconds(e2e, "99%"), "ttft_mean_s": _seconds(ttft, "Average Response Time"),
        "ttft_p99_s": _seconds(ttft, "99%"), "itl_mean_s": _seconds(itl, "Average Response Time"),
        "itl_p99_s": _seconds(itl, "99%"),
    }


def latency(setup: Setup, rates: list[float], duration_s: int, users: int) -> list[dict]:
    prompts = [c for cat in CATEGORIES for c in load_prompts(cat, setup.prompts_per_category)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        prompts_file = workdir / "prompts.json"
        prompts_file.write_text(json.dumps(prompts))
        for method, k in tqdm(setup.methods_with_k(), desc="latency", unit="server"):
            spec = speculative_config(method, setup.drafters.get(method), k)
            with running_server(setup.target, spec, extra_args=["--served-model-name", "bench"],
                                log_path=workdir / f"server-{method}-{k}.log") as base:
                for qps in rates:
                    result = run_rate(base, prompts_file, qps, users, duration_s, setup.max_tokens, workdir)
                    rows.append({"suite": "latency", "method": method, "k": k, "temperature": 0.0, **result})
    return rows
