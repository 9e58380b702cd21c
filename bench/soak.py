"""``python -m bench soak --out DIR``: soak an OpenAI server that serves an EDSD drafter with
vLLM's prompt lookup beside it, under locust, with faults mixed into every round, and say
whether it held.

The server is the one this suite starts (``vllm serve`` on 127.0.0.1 with the target and
drafter given, the demo's by default; K=4 and ``"prompt_lookup_min":2,"prompt_lookup_max":4``)
or, with ``--url``, your own running server (served as ``bench``, ``--served-model-name bench``;
pass ``--pid`` of its API server to watch its memory). For each ``--concurrency`` level, that
many locust users send requests back to back for its share of ``--duration`` seconds, round
after round. Every round mixes, in one batch:

* greedy (T=0) requests of every prompt, streamed and not, capped at 0, 1 and K drafts per step
  (``vllm_xargs={"num_speculative_tokens": n}``) and uncapped;
* seeded requests at T=0.8, and a stream its client walks away from after 4 chunks;
* bad requests: caps -1, K+1 and "x", a prompt beyond the context, temperature -1, top_p 2, a
  body that is not JSON. Each must get a 4xx whose error names the field, never a 5xx.

Writes DIR/results.json, DIR/report.md and DIR/memory.png:

* requests per outcome, every fault (a 5xx, a bad request answered otherwise than with a 4xx
  naming its field, a good request that failed) and each bad request's outcomes;
* the greedy replies under load against the same requests (prompt and cap) sent one at a time to
  the same server afterwards: the share equal, and which differ (a near-tie broken otherwise in
  a larger batch can part a float16/bfloat16 reply; float32 keeps them equal);
* the resident memory of every server process over time (the plot), sampled with psutil, and
  its growth from the 5th minute to the end;
* lines of the server's log with "Traceback" or "Exception ignored" while it served;
* ``/metrics`` after the load: running and waiting requests and the KV cache use must be 0
  (prefix caching keeps blocks cached, not in use);
* for a server it started: seconds from SIGTERM (to the API server, as ``kill`` or Kubernetes
  sends it) to its last process gone, any process left, and the log's problems on the way out.

``--offline`` also runs ``vllm.LLM`` itself (bench/soak_offline.py): requests aborted in the
middle of a ``step()`` loop, the others' greedy outputs checked and the KV blocks freed.

Exit status 1 when a rule broke: a 5xx, a bad request not refused with its field named, a good
request failed, under 90 % of the greedy replies equal, resident memory grown 5 % or more from the
5th minute on (in a run of 10 minutes or more), a log problem while serving, state left after
the load, or a process left after SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

from vllm_edsd.errors import EDSDError
from vllm_edsd.launch.server import default_dtype, post_json, running_server
from vllm_edsd.methods.registry import EDSD

from .arguments import numbers, target_and_drafter
from .latency import DRAIN_S, run_plan
from .machine import machine
from .offline import NGRAM_LENGTHS, load_prompts
from .soak_load import FAULTS, compare_greedy, judge, round_requests
from .soak_watch import (
    MemoryWatch,
    log_problems,
    log_size,
    memory_growth,
    new_marker,
    plot_memory,
    read_from,
    request_state,
    server_pid,
    sigterm,
)

ENGINE_GRACE_S = 5  # vLLM's process manager waits this long for its engine processes after SIGTERM
BUSY_CPU_SLACK_S = 25  # on top, for interpreters ending on a loaded 2-core machine
# The share of greedy replies under load that must equal the same request's alone: a 16-bit run
# may part at a near-tie now and then (float32 keeps all equal; the report lists each one).
GREEDY_EQUAL_FLOOR = 0.9
MEMORY_GROWTH_CEILING_PERCENT = 5  # from the 5th minute to the end, in a run of 10 minutes or more


def speculative_config(drafter: str, k: int) -> dict:
    """EDSD with the prompt lookup beside it, as the suite serves it."""
    return {"method": EDSD, "model": drafter, "num_speculative_tokens": k, **NGRAM_LENGTHS}


def shutdown_limit_s(shutdown_timeout: float) -> float:
    """How long SIGTERM may take to end every process: vLLM's documented drain
    (``--shutdown-timeout``, 0 by default: abort) and engine grace, plus a busy CPU's slack."""
    return shutdown_timeout + ENGINE_GRACE_S + BUSY_CPU_SLACK_S


@dataclass
class Server:
    """A server under soak: its URL, its API server's pid (None: memory not watched), its log
    (None: not ours to read), where the log stood when it became healthy, and how it ended."""

    base: str
    pid: int | None
    log: Path | None = None
    healthy_at: int = 0
    shutdown: dict = field(default_factory=dict)

    def serving_problems(self) -> list[str]:
        """The log's exception lines since the server became healthy."""
        return log_problems(read_from(self.log, self.healthy_at))


@contextmanager
def serving(target: str, spec: dict, extra_args: list[str], log: Path, shutdown_timeout: float = 0,
            env: dict[str, str] | None = None) -> Iterator[Server]:
    """Start the server (``running_server``, with ``--shutdown-timeout``) and yield it; on the way
    out, SIGTERM it and record how it ended (``Server.shutdown``) before the launcher's own stop
    kills whatever is left."""
    marker = new_marker()
    args = [*extra_args, "--shutdown-timeout", str(shutdown_timeout)]
    with running_server(target, spec, extra_args=args, log_path=log, env={**(env or {}), **marker}) as base:
        pid = server_pid(marker["EDSD_SOAK_MARKER"])
        if pid is None:
            raise EDSDError("the server started, but its process was not found")
        server = Server(base, pid, log, log_size(log))
        yield server
        if not server.shutdown:  # not stopped already by whoever used it
            stop(server, shutdown_limit_s(shutdown_timeout))


def stop(server: Server, limit_s: float) -> None:
    """SIGTERM the server; how long it took, what was left, and the log's problems on the way out."""
    before = log_size(server.log)
    server.shutdown = {**sigterm(server.pid, limit_s), "limit_s": limit_s}
    server.shutdown["log_problems"] = log_problems(read_from(server.log, before))


def served_max_model_len(base: str) -> int:
    """The server's context (``/v1/models``): the bad prompt is made longer than it."""
    import requests

    return requests.get(f"{base}/v1/models", timeout=30).json()["data"][0]["max_model_len"]


def replies_alone(base: str, requests: list[dict]) -> list[list[int]]:
    """Each greedy request of the round (its cap, its prompt) sent one at a time and whole: its
    reply's token ids, by prompt index."""
    url = f"{base}/v1/chat/completions"
    greedy = sorted((r for r in requests if "greedy" in r), key=lambda r: r["greedy"])
    bodies = [{key: value for key, value in r["body"].items() if key != "stream_options"} for r in greedy]
    return [post_json(url, {**body, "stream": False}, DRAIN_S)["choices"][0]["token_ids"] for body in bodies]


def soak_level(base: str, requests: list[dict], users: int, seconds: float, workdir: Path, name: str) -> list[dict]:
    """``users`` users sending ``requests`` in turn, back to back, for ``seconds``."""
    plan = {"requests": requests, "stop_after_s": seconds}
    return run_plan(base, plan, users, seconds + DRAIN_S, workdir, name)


def soak(server: Server, prompts: list[list[dict]], args: argparse.Namespace, out: Path) -> dict:
    """Every concurrency level's share of the duration under the mixed load; the verdicts."""
    requests = round_requests(prompts, args.max_tokens, args.k, served_max_model_len(server.base))
    levels, seconds = {}, args.duration / len(args.concurrency)
    watch = MemoryWatch(server.pid) if server.pid else None
    records = []
    with watch.running() if watch else nullcontext():
        for users in args.concurrency:
            began = time.time()
            level = soak_level(server.base, requests, users, seconds, out, f"soak-u{users}")
            levels[users] = {"requests": len(level), "wall_s": round(time.time() - began, 1), **judge(level, requests)}
            if watch:
                levels[users]["rss_mib"] = watch.mark()
            print(f"concurrency {users}: {len(level)} requests, {levels[users]['outcomes']}", flush=True)
            records += level
    return {"levels": levels, "overall": judge(records, requests), "round": [r["what"] for r in requests],
            "greedy": compare_greedy(records, requests, replies_alone(server.base, requests)),
            "state_after_load": request_state(server.base), "serving_log_problems": server.serving_problems(),
            "memory_samples": watch.samples if watch else [],
            "memory_growth": memory_growth(watch.samples) if watch else None}


def broken_rules(results: dict) -> list[str]:
    """Each rule the run broke, as one line (none: the server held)."""
    broken = []
    overall, greedy = results["overall"], results["greedy"]
    broken += [f"{count} request(s): {name}" for name, count in overall["outcomes"].items() if name in FAULTS]
    if greedy["compared"] and greedy["equal"] < GREEDY_EQUAL_FLOOR * greedy["compared"]:
        broken.append(f"{greedy['compared'] - greedy['equal']} of {greedy['compared']} greedy replies differ "
                      f"(more than {1 - GREEDY_EQUAL_FLOOR:.0%})")
    growth = results.get("memory_growth")
    if growth and growth["growth_percent"] >= MEMORY_GROWTH_CEILING_PERCENT:
        broken.append(f"resident memory grew {growth['growth_percent']} % from minute 5 to the end "
                      f"({growth['from_mib']} to {growth['end_mib']} MiB)")
    if results["serving_log_problems"]:
        broken.append(f"{len(results['serving_log_problems'])} exception line(s) in the log while serving")
    if not results["state_after_load"]["empty"]:
        broken.append(f"state left after the load: {results['state_after_load']}")
    shutdown = results.get("shutdown") or {}
    if shutdown.get("left"):
        broken.append(f"processes left {shutdown['limit_s']:.0f} s after SIGTERM: {', '.join(shutdown['left'])}")
    return broken


def check(args: argparse.Namespace) -> None:
    """Bad values are one line each, before any server starts."""
    args.concurrency = numbers("--concurrency", args.concurrency, int, 1)
    if max(args.concurrency) > 32:
        raise EDSDError(f"--concurrency takes levels from 1 to 32; got {max(args.concurrency)}")
    for flag, value, least in (("--duration", args.duration, 1), ("--k", args.k, 1),
                               ("--max-tokens", args.max_tokens, 1), ("--prompts", args.prompts, 1),
                               ("--shutdown-timeout", args.shutdown_timeout, 0),
                               ("--tensor-parallel-size", args.tensor_parallel_size, 1),
                               ("--data-parallel-size", args.data_parallel_size, 1)):
        if value < least:
            raise EDSDError(f"{flag} must be at least {least}; got {value}")


def rank_binding(ranks: int) -> dict[str, str]:
    """vLLM's CPU binding for ``ranks`` engine workers (tensor x data parallel): the cores this
    process may use, split into that many groups (``"0|1"`` on two cores); the user's own
    ``VLLM_CPU_OMP_THREADS_BIND`` wins. One rank keeps vLLM's automatic binding."""
    if ranks == 1 or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return {}
    cpus = sorted(os.sched_getaffinity(0))
    if ranks > len(cpus):
        raise EDSDError(f"{ranks} ranks (--tensor-parallel-size x --data-parallel-size) need as many cores; "
                        f"this process may use {len(cpus)}")
    share = len(cpus) // ranks
    groups = [cpus[i * share:(i + 1) * share] for i in range(ranks)]
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(",".join(map(str, group)) for group in groups)}


@contextmanager
def server_for(args: argparse.Namespace, out: Path) -> Iterator[Server]:
    """The user's server (``--url``) or one started here, with its parallelism."""
    if args.url:
        yield Server(args.url.rstrip("/"), args.pid)
        return
    target, drafter = target_and_drafter(args.target, EDSD, args.edsd)
    extra = ["--served-model-name", "bench", "--dtype", args.dtype or default_dtype(),
             "--tensor-parallel-size", str(args.tensor_parallel_size),
             "--data-parallel-size", str(args.data_parallel_size)]
    extra += ["--enforce-eager"] if args.eager else []
    spec = speculative_config(drafter, args.k)
    env = rank_binding(args.tensor_parallel_size * args.data_parallel_size)
    with serving(target, spec, extra, out / "server.log", args.shutdown_timeout, env) as server:
        yield server


def run(args: argparse.Namespace) -> int:
    """The soak (and the offline variant with ``--offline``); exit status 1 when a rule broke."""
    check(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = load_prompts("chat", args.prompts)
    results = {"command": args.command, "machine": machine(), "duration_s": args.duration,
               "concurrency": args.concurrency, "k": args.k, "max_tokens": args.max_tokens,
               "server": args.url or "started by the suite", "shutdown_timeout": args.shutdown_timeout,
               "dtype": None if args.url else args.dtype or default_dtype(),
               "tensor_parallel_size": args.tensor_parallel_size, "data_parallel_size": args.data_parallel_size}
    with server_for(args, out) as server:
        results.update(soak(server, prompts, args, out))
    results["shutdown"] = server.shutdown
    if args.offline:
        from .soak_offline import offline_soak

        target, drafter = target_and_drafter(args.target, EDSD, args.edsd)
        results["offline"] = offline_soak(target, speculative_config(drafter, args.k), args)
    results["broken_rules"] = broken_rules(results) + (results.get("offline") or {}).get("broken_rules", [])
    write(out, results)
    print("\n".join(results["broken_rules"]) or "the server held: no rule broke")
    print(out / "report.md")
    return 1 if results["broken_rules"] else 0


def write(out: Path, results: dict) -> None:
    """results.json, report.md and, where memory was watched, memory.png."""
    from .soak_report import render

    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    if results["memory_samples"]:
        plot_memory(results["memory_samples"], out / "memory.png")
    (out / "report.md").write_text(render(results))
