"""``edsd demo`` stopped by SIGTERM leaves no child behind: neither the server it started nor,
offline, the vLLM engine's own processes (EngineCore, Worker) of an engine that is generating."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

# A demo stopped while vLLM builds its engine stops only when the engine is built: vLLM's
# EngineCore defers SIGTERM and SIGINT until then. Offline, the demo is stopped while it generates.
# Eager engines: SIGTERM's path is the same, and torch.compile took about a minute of each start in CI.
FLAGS = {"server": ["--max-tokens", "4", "--eager"], "offline": ["--offline", "--max-tokens", "192", "--eager"]}


def _running(process) -> bool:
    import psutil

    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _command_line(process) -> str:
    """The process's command line; empty for one that exited, or turned zombie, since it was listed."""
    import psutil

    try:
        return " ".join(process.cmdline())
    except psutil.Error:
        return ""


def _started(how: str, children: list, printed: Path) -> bool:
    """Whether the demo's server is starting, or offline, its first engine is generating."""
    if how == "server":
        return any("api_server" in _command_line(c) for c in children)
    return "prompts, one at a time" in printed.read_text()


@pytest.mark.parametrize("how", sorted(FLAGS))
def test_sigterm_on_demo_leaves_no_child(how, tmp_path):
    import psutil

    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")]),
    }
    printed = tmp_path / "printed.txt"  # a file, not a pipe: a child left running cannot block reading it
    with printed.open("wb") as sink:
        demo = subprocess.Popen([sys.executable, "-m", "vllm_edsd.cli", "demo", "--methods", "edsd", *FLAGS[how]],
                                stdout=sink, stderr=subprocess.STDOUT, env=env)
    parent = psutil.Process(demo.pid)
    deadline = time.time() + 300
    children: list = []
    while time.time() < deadline and demo.poll() is None:
        children = parent.children(recursive=True)
        if _started(how, children, printed):
            break
        time.sleep(0.5)
    assert demo.poll() is None and children, f"the demo did not start ({how}); it printed:\n{printed.read_text()}"
    time.sleep(5)  # the server is busy starting its engine; offline, the engine generates
    children = parent.children(recursive=True)
    demo.send_signal(signal.SIGTERM)
    try:
        demo.wait(timeout=30)
    except subprocess.TimeoutExpired:
        for process in [*children, demo]:  # nothing left for the tests after this one
            process.kill()
        pytest.fail(f"the demo still ran 30 s after SIGTERM; it printed:\n{printed.read_text()}")
    _, alive = psutil.wait_procs(children, timeout=10)
    # an orphan that PID 1 has not reaped yet is a zombie: it has stopped
    alive = [p for p in alive if _running(p)]
    assert not alive, [_command_line(p) for p in alive]
    assert demo.returncode != 0 and "Traceback" not in printed.read_text()
