"""What the soak suite watches on the server, from outside it: its processes and their resident
memory over time, its ``/metrics`` gauges once the load is over, its log, and how it ends on
SIGTERM. Works the same on a server the suite started and on a user's own (``--url``, ``--pid``).
"""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import psutil

# Series of vLLM's /metrics that hold per-request state, and what each must read once idle.
RUNNING, WAITING, KV_USAGE = "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"
LOG_PROBLEMS = ("Traceback", "Exception ignored")


def alive(proc: psutil.Process) -> bool:
    """Whether a process still runs (a zombie waiting for its parent to reap it does not)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def process_tree(pid: int) -> list[psutil.Process]:
    """The API server and every process under it (engine cores, workers, resource trackers)."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def server_pid(marker: str) -> int | None:
    """The pid of the server this process started with ``marker`` in its environment."""
    for child in psutil.Process().children():
        try:
            if child.environ().get("EDSD_SOAK_MARKER") == marker:
                return child.pid
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return None


def new_marker() -> dict[str, str]:
    """An environment entry that tells this run's server from any other on the machine."""
    return {"EDSD_SOAK_MARKER": uuid.uuid4().hex}


def label(proc: psutil.Process) -> str:
    """``name[pid]``: vLLM names its processes (``VLLM::EngineCore``, ``VLLM::Worker``)."""
    try:
        return f"{proc.name()}[{proc.pid}]"
    except psutil.NoSuchProcess:
        return f"?[{proc.pid}]"


def rss_mib(procs: list[psutil.Process]) -> dict[str, float]:
    """Resident memory (MiB) of each live process, by ``label``."""
    sizes = {}
    for proc in procs:
        try:
            sizes[label(proc)] = round(proc.memory_info().rss / 2**20, 1)
        except psutil.NoSuchProcess:
            continue
    return sizes


@dataclass
class MemoryWatch:
    """Samples the resident memory of the server's processes every ``every_s`` seconds in a
    thread of its own: ``samples`` holds [seconds since start, {process: MiB}]."""

    pid: int
    every_s: float = 2.0
    samples: list = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def _run(self) -> None:
        """Sample until stopped."""
        start = time.time()
        while not self._stop.is_set():
            self.samples.append([round(time.time() - start, 1), rss_mib(process_tree(self.pid))])
            self._stop.wait(self.every_s)

    def mark(self) -> dict[str, float]:
        """A sample now (also recorded), for a phase's end."""
        sizes = rss_mib(process_tree(self.pid))
        start_s = self.samples[-1][0] if self.samples else 0.0
        self.samples.append([start_s, sizes])
        return sizes

    @contextmanager
    def running(self) -> Iterator[MemoryWatch]:
        """Sample while the block runs."""
        thread = threading.Thread(target=self._run, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            thread.join()


SETTLED_S = 300  # the first minutes fill the allocator's and oneDNN's caches for the batch shapes met


def memory_growth(samples: list) -> dict | None:
    """The server's total resident memory at the first sample from the 5th minute on and at the
    end, and the growth between them in percent (None: the run was not twice that long)."""
    totals = [(t, sum(sizes.values())) for t, sizes in samples if sizes]
    settled = next(((t, total) for t, total in totals if t >= SETTLED_S), None)
    if settled is None or totals[-1][0] < 2 * SETTLED_S:
        return None
    return {"from_s": settled[0], "from_mib": round(settled[1]), "end_mib": round(totals[-1][1]),
            "growth_percent": round(100 * (totals[-1][1] / settled[1] - 1), 2)}


def plot_memory(samples: list, path: Path) -> None:
    """The resident memory of each server process and their total over time, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    names = sorted({name for _, sizes in samples for name in sizes})
    times = [t for t, _ in samples]
    for name in names:
        ax.plot(times, [sizes.get(name) for _, sizes in samples], label=name)
    ax.plot(times, [sum(sizes.values()) for _, sizes in samples], label="total", color="black", linewidth=2)
    ax.set_xlabel("seconds since the server was healthy")
    ax.set_ylabel("resident memory (MiB)")
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def metric_values(text: str, series: tuple[str, ...]) -> dict[str, float]:
    """For each of ``series`` (a metric's name, or its name and the start of its labels:
    ``'vllm:request_success_total{engine="0",finished_reason="length"'``), the sum of the lines of a
    /metrics page that it starts (every engine's, every label's)."""
    values = dict.fromkeys(series, 0.0)
    for line in text.splitlines():
        for key in series:
            if line.startswith(key) and ("{" in key or line[len(key)] in "{ "):
                values[key] += float(line.rsplit(" ", 1)[1])
    return values


def request_state(base: str, limit_s: float = 30) -> dict:
    """Running and waiting requests and KV cache use once the load is over, read until all are 0
    or ``limit_s`` passes (vLLM sets the gauges after each step); ``empty``: whether they were."""
    import requests

    deadline = time.time() + limit_s
    while True:
        values = metric_values(requests.get(f"{base}/metrics", timeout=10).text, (RUNNING, WAITING, KV_USAGE))
        empty = not any(values.values())
        if empty or time.time() > deadline:
            return {**values, "empty": empty}
        time.sleep(0.5)


def log_problems(text: str) -> list[str]:
    """The lines of a server log that start or report an exception ("Traceback", "Exception ignored")."""
    return [line.strip() for line in text.splitlines() if any(problem in line for problem in LOG_PROBLEMS)]


def log_size(path: Path | None) -> int:
    """Where a log ends now (0 without one): the start of what it writes next."""
    return path.stat().st_size if path and path.exists() else 0


def read_from(path: Path | None, offset: int) -> str:
    """A log's text from byte ``offset`` on (what it wrote since then)."""
    if path is None or not path.exists():
        return ""
    with open(path, "rb") as log:
        log.seek(offset)
        return log.read().decode(errors="replace")


def sigterm(pid: int, limit_s: float) -> dict:
    """SIGTERM to the API server alone (as a terminal's kill, systemd or Kubernetes sends it), then
    wait up to ``limit_s`` for it and every process under it to end: seconds until the last one
    was gone, and those still running at the limit (``left``)."""
    procs = process_tree(pid)
    labels = {proc.pid: label(proc) for proc in procs}
    start = time.time()
    os.kill(pid, signal.SIGTERM)
    while any(map(alive, procs)) and time.time() - start < limit_s:
        time.sleep(0.05)
    left = [labels[proc.pid] for proc in procs if alive(proc)]
    return {"processes": len(procs), "gone_s": None if left else round(time.time() - start, 2), "left": left}
