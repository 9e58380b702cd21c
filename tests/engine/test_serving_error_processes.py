"""A process that asked for a bad drafter exits with the one-line error instead of hanging:
``LLM(...)`` in a script, and the OpenAI server (vLLM's own config path, no mocks)."""

from __future__ import annotations

import json
import subprocess
import sys

from support.drafters import edited_copy
from support.drafters import edsd_spec as spec


def server_exit(*args: str) -> subprocess.CompletedProcess:
    """The OpenAI server started with ``args``, expected to exit before an engine starts."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--port", "0",
           "--gpu-memory-utilization", "0.25", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def assert_one_error_line(proc: subprocess.CompletedProcess, expected: str) -> None:
    assert proc.returncode == 2
    # The reason is one line of its own, not the last line of a vLLM traceback.
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("vllm-edsd: error:")]
    assert len(errors) == 1 and expected in errors[0], proc.stderr[-3000:]


def test_offline_process_exits_with_the_message(models, drafters):
    script = (
        "from vllm import LLM\n"
        "if __name__ == '__main__':\n"
        f"    LLM({models['llama']!r}, gpu_memory_utilization=0.25, "
        f"speculative_config={spec(drafters['missing_tensor'])!r})\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "missing tensor(s): lm_head.weight" in proc.stderr


def test_server_exits_with_the_message(models, drafters):
    proc = server_exit("--model", models["llama"], "--speculative-config", json.dumps(spec(drafters["other_target"])))
    assert_one_error_line(proc, "does not fit the target model")


def test_server_of_a_drafter_directory_without_its_verifier_exits_with_the_message(models, tmp_path):
    """``vllm serve DRAFTER_DIR`` whose config.json names a target that is not there
    (docs/formats.md, "Speculators format"): one line naming it, before vLLM looks for it."""
    gone = tmp_path / "moved-target"
    drafter = edited_copy(models["llama-edsd"], tmp_path / "drafter",
                          edit_config=lambda c: c["speculators_config"]["verifier"].update(name_or_path=str(gone)))
    assert_one_error_line(server_exit("--model", str(drafter)), f"no such local directory: {gone}")
