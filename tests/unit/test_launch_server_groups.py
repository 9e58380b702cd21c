"""A server's process group counts as stopped when only zombies are left in it."""

from __future__ import annotations

import os
import subprocess
import sys
import time


def _zombie_group_leader() -> subprocess.Popen:
    """A process in its own group that has exited and that nobody has reaped yet: what a killed
    server's engine processes stay as where PID 1 does not reap orphans."""
    import psutil

    proc = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    while psutil.Process(proc.pid).status() != psutil.STATUS_ZOMBIE:
        time.sleep(0.05)
    return proc


def test_a_server_group_left_with_only_zombies_counts_as_stopped():
    from vllm_edsd.launch.server import _group_alive, stop_process_group

    zombie = _zombie_group_leader()
    os.killpg(zombie.pid, 0)  # the group still exists for signals
    assert not _group_alive(zombie.pid)
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    assert _group_alive(running.pid)
    started = time.time()
    stop_process_group(running, grace_s=60)
    assert running.returncode is not None and time.time() - started < 30  # stopped by SIGTERM, not the grace
    zombie.wait()
