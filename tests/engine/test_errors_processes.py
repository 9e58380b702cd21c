"""A process that asked for a bad drafter exits with the one-line error instead of hanging:
``LLM(...)`` in a script, and the OpenAI server (vLLM's own config path, no mocks)."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import edsd_spec as spec


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
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", models["llama"],
        "--port", "0", "--gpu-memory-utilization", "0.25",
        "--speculative-config", json.dumps(spec(drafters["other_target"])),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    # The reason is one line of its own, not the last line of a vLLM traceback.
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("vllm-edsd: error:")]
    assert len(errors) == 1 and "does not fit the target model" in errors[0]
