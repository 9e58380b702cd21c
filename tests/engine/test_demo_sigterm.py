"""``edsd demo`` stopped by SIGTERM leaves no server child behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest


def _running(process) -> bool:
    import psutil

    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_sigterm_on_demo_leaves_no_server_child(tmp_path):
    import psutil

    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")]),
    }
    demo = subprocess.Popen([sys.executable, "-m", "vllm_edsd.cli", "demo", "--methods", "edsd", "--max-tokens", "4"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    parent = psutil.Process(demo.pid)
    deadline = time.time() + 300
    children: list = []
    while time.time() < deadline and demo.poll() is None:
        children = parent.children(recursive=True)
        if any("api_server" in " ".join(c.cmdline()) for c in children if c.is_running()):
            break
        time.sleep(0.5)
    assert demo.poll() is None and children, "the demo did not start its server"
    time.sleep(5)  # the server is busy starting its engine
    children = parent.children(recursive=True)
    demo.send_signal(signal.SIGTERM)
    try:
        demo.wait(timeout=30)
    except subprocess.TimeoutExpired:
        demo.kill()
        pytest.fail(f"the demo still ran 30 s after SIGTERM; it printed:\n{demo.stdout.read().decode()}")
    _, alive = psutil.wait_procs(children, timeout=10)
    # an orphan that PID 1 has not reaped yet is a zombie: it has stopped
    alive = [p for p in alive if _running(p)]
    assert not alive, [p.cmdline() for p in alive]
    assert demo.returncode != 0 and "Traceback" not in demo.stdout.read().decode()
