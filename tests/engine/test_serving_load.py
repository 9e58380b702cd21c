"""The OpenAI server with an EDSD drafter under load and faults, traffic only to 127.0.0.1:
a locust soak at and above saturation, and streams the client walks away from. Every greedy
reply must be the one the same request gets without speculation."""

from __future__ import annotations

import json
import math
import time
import uuid
from pathlib import Path

import pytest
import requests
from support.servers import abandon_streams, processes_with

from bench.latency import DRAIN_S, aggregate, poisson_schedule, run_locust
from vllm_edsd.launch.engine import SpecCounters, parse_prometheus_counters
from vllm_edsd.launch.server import running_server

MAX_TOKENS = 64
SOAK_S = 60  # seconds of arrivals at each rate: at saturation, then twice that
MAX_USERS = 128
# What a client that walks away asked for: as much as the context leaves (prompts are under 128
# tokens), so that a late abort (the API server lags the engine on a busy CPU) is still far from
# the end.
ABANDONED_TOKENS = 896
RSS_GROWTH_FLOOR_MIB = 128  # growth over the minute at twice saturation that passes whatever the first minute grew
ARGS = ["--served-model-name", "bench", "--dtype", "float32", "--enforce-eager", "--max-model-len", "1024",
        # A KV cache of 16k tokens (64 MiB here) rather than a quarter of the machine's memory: the
        # pages of a large cache are touched bit by bit under load, which would read as growth.
        "--block-size", "32", "--num-gpu-blocks-override", "512"]


@pytest.fixture(scope="module")
def chats(trained) -> list[list[dict]]:
    return trained["chats"]


@pytest.fixture(scope="module")
def without_speculation(trained, chats, tmp_path_factory) -> list[list[int]]:
    """Each chat's greedy reply (token ids) from the same server without speculation."""
    work = tmp_path_factory.mktemp("plain")
    with running_server(trained["target"], None, extra_args=ARGS, log_path=work / "server.log") as base:
        records = run_locust(base, chats, [0.0] * len(chats), MAX_TOKENS, len(chats), work, "plain")
    assert aggregate(records, len(chats))["failures"] == 0, records
    return [record["token_ids"] for record in sorted(records, key=lambda r: r["id"])]


@pytest.fixture(scope="module")
def edsd_server(trained, tmp_path_factory):
    """The server with the trained, folded EDSD drafter; its processes carry a marker in
    their environment so the test can find the engine's and read its memory."""
    marker = uuid.uuid4().hex
    spec = {"method": "edsd", "model": trained["edsd-folded"], "num_speculative_tokens": 4}
    log = tmp_path_factory.mktemp("edsd-server") / "server.log"
    with running_server(
        trained["target"], spec, extra_args=ARGS, log_path=log, env={"EDSD_TEST_MARKER": marker}
    ) as base:
        yield base, marker


def rss_mib(marker: str) -> dict[str, int]:
    """Resident memory (MiB) of each process of the server (API server, engine core, workers),
    by process name."""
    sizes: dict[str, int] = {}
    for pid in processes_with(marker):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        name = f"{fields['Name'].strip()}[{pid}]"
        sizes[name] = int(fields.get("VmRSS", "0 kB").split()[0]) // 1024
    return sizes


def metric_sum(base: str, prefixes: tuple[str, ...]) -> float:
    """The sum of every series on /metrics whose name starts with one of ``prefixes``."""
    text = requests.get(f"{base}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefixes))


def spec_counters(base: str) -> SpecCounters:
    return parse_prometheus_counters(requests.get(f"{base}/metrics", timeout=10).text)


def settled(base: str, limit_s: float = 30) -> bool:
    """Whether the engine reports nothing running or waiting (vLLM's gauges on /metrics, set
    after each step) within ``limit_s``."""
    deadline = time.time() + limit_s
    while True:
        busy = metric_sum(base, ("vllm:num_requests_running", "vllm:num_requests_waiting"))
        if busy == 0 or time.time() > deadline:
            return busy == 0
        time.sleep(0.5)


def assert_lossless(records: list[dict], chats: list[list[dict]], expected: list[list[int]]) -> None:
    for record in records:
        assert record["token_ids"], f"request {record['id']} came back without tokens"
        assert record["token_ids"] == expected[record["id"] % len(chats)], f"request {record['id']}"


def test_soak_at_and_above_saturation(edsd_server, chats, without_speculation, tmp_path):
    """Saturation is measured first (all requests at once, as many users as the soak has);
    then open-loop Poisson arrivals at that rate and at twice it, a minute each: no request
    fails, every reply is the one without speculation, and the server's memory stays bounded."""
    base, marker = edsd_server
    before = spec_counters(base)
    burst = len(chats) * 8
    records = run_locust(base, [chats[i % len(chats)] for i in range(burst)], [0.0] * burst, MAX_TOKENS,
                         MAX_USERS, tmp_path, "burst")
    assert aggregate(records, burst)["failures"] == 0
    assert_lossless(records, chats, without_speculation)
    # The last request to end stops locust; it must not wait out its time limit.
    assert "--run-time limit reached" not in (tmp_path / "burst.locust.log").read_text()
    busy_s = max(r["start_s"] + r["e2e_s"] for r in records) - min(r["start_s"] for r in records)
    saturation_qps = burst / busy_s
    report = {"saturation_qps": round(saturation_qps, 2), "rss_mib": {"warm": rss_mib(marker)}}
    assert len(report["rss_mib"]["warm"]) >= 2, f"the server's processes were not found: {report['rss_mib']}"
    for load in (1, 2):
        qps = load * saturation_qps
        n = math.ceil(qps * SOAK_S)
        messages = [chats[i % len(chats)] for i in range(n)]
        # Above saturation the arrivals leave a backlog of (load - 1) * SOAK_S seconds of work
        # at the measured rate; the run may take twice that, on top of the usual drain.
        drain_s = DRAIN_S + 2 * (load - 1) * SOAK_S
        records = run_locust(base, messages, poisson_schedule(qps, n), MAX_TOKENS, MAX_USERS, tmp_path, f"x{load}",
                             drain_s)
        row = aggregate(records, n)
        report[f"{load}x"] = {key: row[key] for key in ("num_requests", "failures", "achieved_qps", "late_starts",
                                                        "e2e_p99_s", "output_tokens_per_s")}
        assert row["failures"] == 0, (row["failure_reasons"], report)
        assert_lossless(records, chats, without_speculation)
        report["rss_mib"][f"{load}x"] = rss_mib(marker)
    print("soak:", json.dumps(report))
    rss = {phase: sum(sizes.values()) for phase, sizes in report["rss_mib"].items()}
    assert all(report["rss_mib"].values()), f"a phase found none of the server's processes: {report['rss_mib']}"
    counters = spec_counters(base) - before
    assert counters.drafts > 0 and counters.accepted > 0.05 * counters.drafts, f"the EDSD server's counters: {counters}"
    # The worker's memory grows during its first minute under load (oneDNN and allocator caches
    # for the batch shapes it meets: +421 and +463 MiB in two CI runs) and then levels off (+142
    # and +51 MiB over the next minute). A leak grows with the requests served, so the minute at
    # twice the load, serving twice the requests, would add more than the first minute did.
    first, second = rss["1x"] - rss["warm"], rss["2x"] - rss["1x"]
    assert second <= max(first, RSS_GROWTH_FLOOR_MIB), report
    assert settled(base)


def test_streams_aborted_mid_way_free_their_requests(edsd_server, chats, without_speculation, tmp_path):
    """Clients that close their stream after a few chunks, drafts in flight: the engine keeps
    serving, stays lossless, and holds nothing of theirs afterwards (nothing running or waiting)."""
    base, _ = edsd_server
    body = {"model": "bench", "max_tokens": ABANDONED_TOKENS, "temperature": 0, "ignore_eos": True}
    ran_to_length = 'vllm:request_success_total{engine="0",finished_reason="length"'
    finished_before = metric_sum(base, (ran_to_length,))
    chunks_read = abandon_streams(f"{base}/v1/chat/completions", [{**body, "messages": chat} for chat in chats])
    assert len(chunks_read) == len(chats) and min(chunks_read) > 0
    records = run_locust(base, chats, [0.0] * len(chats), MAX_TOKENS, len(chats), tmp_path, "after-aborts")
    assert aggregate(records, len(chats))["failures"] == 0
    assert_lossless(records, chats, without_speculation)
    assert settled(base), "aborted requests are still running or waiting"
    # vLLM counts a request that ends at max_tokens and none that it aborts. An abort lands as
    # late as the API server gets the CPU (seconds on a busy 2-core machine, while the engine
    # generates on), so some abandoned requests may reach their end; aborts that never reach
    # the engine would let every one of them do so.
    ran_to_end = metric_sum(base, (ran_to_length,)) - finished_before - len(chats)
    assert ran_to_end < len(chats), f"all {len(chats)} abandoned requests ran to their end: no abort reached the engine"
