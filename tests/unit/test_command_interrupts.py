"""A SIGTERM stops an ``edsd`` command or a bench suite as Ctrl-C does: every ``finally`` on the
way out runs (where engines and servers are shut down), one line says so, exit status 130."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).parents[2]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}

# A command whose run() waits in a try/finally, as a stage holding a vLLM engine does.
WAITING = textwrap.dedent("""
    import sys, time, types

    def run(args):
        try:
            print("started", flush=True)
            time.sleep(60)
        finally:
            print("cleaned up", flush=True)

    waiting = types.ModuleType("waiting")
    waiting.name, waiting.run = "waiting", run
""")

CALLERS = {
    "edsd": WAITING + textwrap.dedent("""
        from vllm_edsd.command import invoke
        sys.exit(invoke(waiting, None))
    """),
    "bench": WAITING + textwrap.dedent("""
        from bench import cli
        sys.modules["bench.waiting"] = waiting
        cli.SUITES["waiting"] = cli.Suite("waits a minute", "waiting", lambda parser: None)
        sys.exit(cli.main(["waiting"]))
    """),
}


@pytest.mark.parametrize("caller", sorted(CALLERS))
def test_sigterm_runs_the_clean_up_and_says_interrupted(caller):
    process = subprocess.Popen([sys.executable, "-c", CALLERS[caller]], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=ENV)
    assert process.stdout.readline().strip() == "started"
    time.sleep(0.2)
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=30)
    assert process.returncode == 130
    assert "cleaned up" in out
    assert err.strip().endswith(f"{caller} waiting: interrupted") and "Traceback" not in err


# A command that swallows the interrupt, as vLLM's engine start-up does (docs/known-issues.md).
SWALLOWING = textwrap.dedent("""
    import sys, time, types
    from vllm_edsd.command import invoke

    def run(args):
        try:
            print("started", flush=True)
            time.sleep(60)
        except KeyboardInterrupt:
            print("swallowed", flush=True)
        time.sleep(60)

    swallowing = types.ModuleType("swallowing")
    swallowing.name, swallowing.run = "swallowing", run
    sys.exit(invoke(swallowing, None))
""")


def test_a_second_sigterm_ends_a_command_that_lost_the_first():
    process = subprocess.Popen([sys.executable, "-c", SWALLOWING], stdout=subprocess.PIPE, text=True, env=ENV)
    assert process.stdout.readline().strip() == "started"
    time.sleep(0.2)
    process.send_signal(signal.SIGTERM)
    assert process.stdout.readline().strip() == "swallowed"
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=30)
    assert process.returncode == -signal.SIGTERM
