"""Engine jobs for ``engine_job.py``: their phases (prompts and sampling), the engines the tests
share (configurations and cache sizes), and running one job in a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support.drafters import edsd_spec
from support.prompts import FITTED_TOKENS, PROMPTS, SHARED_PREFIX_CAPS, SHARED_PREFIX_PROMPTS, SHARED_PREFIX_TOKENS

ENGINE_TIMEOUT_S = int(os.environ.get("EDSD_TEST_ENGINE_TIMEOUT", "900"))
MAX_MODEL_LEN = 256
# 10 blocks of 32 tokens (the CPU attention's block size is a multiple of 32) hold 320 tokens:
# eight FITTED_TOKENS requests on the fitted target start in about 10 blocks and grow to 19
# together, so the scheduler must preempt, while any one of them fits (vLLM refuses a cache
# that cannot hold max_model_len).
SMALL_CACHE = {"block_size": 32, "num_gpu_blocks_override": 10, "max_model_len": MAX_MODEL_LEN}


def in_process_core() -> dict[str, str]:
    """The environment for a command whose offline engines (vLLM's ``LLM``) keep their engine core
    in the process that builds them, as engine_job.py runs it: a second process imports vLLM and
    the plugin again, and the bench's throughput run of three EDSD variants took 79 s without it
    against 156 s (2-core AMD EPYC with AVX512-BF16, toy targets in float32, eager). vLLM's
    server (AsyncLLM) ignores the setting: its engine core keeps a process of its own. Not for
    ``bench all`` or ``edsd features``, which failed or hung so (docs/known-issues.md, "engines
    whose core runs in the caller's process")."""
    return {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


# What Python prints for an error nobody handled: a traceback, or a finaliser's failure.
TRACEBACK_MARKS = ("Traceback (most recent call last)", "Exception ignored in")


def assert_no_traceback(log_file: Path, what: str) -> None:
    """Fail when an engine's output holds a traceback: a user who sees one cannot tell whether
    the engine is broken, even where it went on (issue #74: a finaliser's, at engine start)."""
    lines = log_file.read_text(errors="replace").splitlines()
    found = [i for i, line in enumerate(lines) if any(mark in line for mark in TRACEBACK_MARKS)]
    if found:
        shown = "\n".join(lines[found[0]:found[0] + 30])
        pytest.fail(f"{what} printed {len(found)} traceback(s) ({log_file}); the first:\n{shown}")


def run_engine_job(job: dict, workdir: Path, env: dict | None = None) -> dict:
    """Run ``engine_job.py`` on ``job``; fail the test with the engine's log on error, and on any
    traceback in that log."""
    workdir.mkdir(parents=True, exist_ok=True)
    job_file, out_file, log_file = workdir / "job.json", workdir / "out.json", workdir / "engine.log"
    job_file.write_text(json.dumps(job))
    full_env = {**os.environ, "VLLM_ALLOW_INSECURE_SERIALIZATION": "1", **(env or {})}
    with open(log_file, "w") as log:
        proc = subprocess.run(
            [sys.executable, str(Path(__file__).parent / "engine_job.py"), str(job_file), str(out_file)],
            stdout=log, stderr=subprocess.STDOUT, env=full_env, timeout=ENGINE_TIMEOUT_S,
        )
    if proc.returncode != 0:
        tail = log_file.read_text()[-6000:]
        pytest.fail(f"engine job failed (exit {proc.returncode}); log tail:\n{tail}")
    assert_no_traceback(log_file, "the engine job")
    return json.loads(out_file.read_text())


def greedy_phase(name: str = "greedy", prompts: list | None = None, max_tokens: int = 48, **extra) -> dict:
    return {
        "name": name,
        "prompts": prompts or PROMPTS,
        "sampling": {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True},
        **extra,
    }


def capped_phase(name: str, prompts: list, caps: list, max_tokens: int, alone: bool = False) -> dict:
    """A greedy phase with one cap per prompt (None: no cap), the whole batch at once, every
    draft step's rows recorded with their caps (``alone``: one request at a time, every chain
    recorded)."""
    phase = greedy_phase(name, prompts, max_tokens, **{"record_proposals" if alone else "record_batch": True})
    phase["sampling"] = [{**phase["sampling"], "extra_args": {} if cap is None else {"num_speculative_tokens": cap}}
                         for cap in caps]
    return phase


def serve_fitted(trained: dict, engine_runs, key: str, spec: dict | None, eager: bool = True,
                 model: str | None = None) -> dict:
    """The greedy phase of an engine on the fitted target and ``trained["prompts"]``. ``model``
    is what vLLM is given instead of the target: a drafter directory served alone, which names
    the target itself (docs/formats.md, "Speculators format")."""
    job = {"target": model or trained["target"], "speculative_config": spec,
           "llm_kwargs": {"enforce_eager": eager, "dtype": "float32"},
           "phases": [greedy_phase(prompts=trained["prompts"], max_tokens=FITTED_TOKENS)]}
    return engine_runs(key, job)["phases"]["greedy"]


def llama_edsd_eager(models: dict, engine_runs) -> dict:
    """The toy Llama target with its EDSD drafter (K=4), eager and in float32 like the reference,
    vLLM's defaults otherwise (prefix caching on): PROMPTS (test_serving_engines.py), then
    SHARED_PREFIX_PROMPTS one at a time with their caps (test_serving_prefix_caching.py), every chain
    and each request's drafter forwards recorded."""
    job = {
        "target": models["llama"],
        "speculative_config": edsd_spec(models["llama-edsd"]),
        "llm_kwargs": {"enforce_eager": True, "dtype": "float32"},
        "phases": [greedy_phase(record_proposals=True),
                   {**capped_phase("shared-prefix", SHARED_PREFIX_PROMPTS, SHARED_PREFIX_CAPS, SHARED_PREFIX_TOKENS,
                                   alone=True), "count_drafter_forwards": True}],
    }
    return engine_runs("llama-edsd-eager", job)


def per_request_metrics() -> bool:
    """Whether this vLLM reports spec-decode metrics per request (0.32 does, 0.27 does not)."""
    from vllm.config import ObservabilityConfig

    return "per_request_spec_decode_metrics" in ObservabilityConfig.__dataclass_fields__
