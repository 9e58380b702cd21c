"""Engine jobs for ``engine_job.py``: their phases (prompts and sampling), the engines the tests
share (configurations and cache sizes), and running one job in a process of its own (forked from
one that imported vLLM once, or fresh where the job brings settings of its own)."""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import threading
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
    in the process that builds them, as engine_job.py runs it: on a CPU vLLM otherwise starts two
    more processes per engine (its core and its worker), each importing vLLM and the plugin again,
    and the bench's throughput run of three EDSD variants took 79 s without it against 156 s
    (2-core AMD EPYC with AVX512-BF16, toy targets in float32, eager). vLLM's server (AsyncLLM)
    ignores the setting: its engine core keeps a process of its own. ``bench all`` only with
    EDSD's engine before the prompt lookup's, and not ``edsd features``, which failed or hung so
    (docs/known-issues.md, "engines whose core runs in the caller's process")."""
    return {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


ENGINE_JOB = Path(__file__).parent / "engine_job.py"


def engine_env() -> dict[str, str]:
    """The environment of an engine job: this worker's (its core, KV cache and compile cache are
    set when pytest configures it, after this module is imported)."""
    return {**os.environ, "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}


class EngineForks:
    """This process's ``engine_job.py --forks``: every engine job of a test worker runs in a child
    forked from one process that imported vLLM once (started at the first job, ended with this
    process)."""

    def __init__(self) -> None:
        self.server: subprocess.Popen | None = None
        self.env: dict[str, str] = {}

    def run(self, job_file: Path, out_file: Path, log_file: Path) -> int:
        """The job's exit status (negative: killed by that signal); a job still running after
        ENGINE_TIMEOUT_S is killed and fails its test."""
        if self.server is None or self.server.poll() is not None or self.env != engine_env():
            if self.server is not None:  # the server of another environment ends at end of stdin
                self.server.stdin.close()
                self.server.wait()
            self.env = engine_env()  # a job sees the environment of the moment it was asked for
            self.server = subprocess.Popen([sys.executable, str(ENGINE_JOB), "--forks"], stdin=subprocess.PIPE,
                                           stdout=subprocess.PIPE, env=self.env, text=True)
            atexit.register(self.server.stdin.close)
        self.server.stdin.write(json.dumps([str(job_file), str(out_file), str(log_file)]) + "\n")
        self.server.stdin.flush()
        pid = self._reply(log_file)
        killed = threading.Event()
        timer = threading.Timer(ENGINE_TIMEOUT_S, lambda: (killed.set(), os.kill(pid, signal.SIGKILL)))
        timer.start()
        try:
            status = self._reply(log_file)
        finally:
            timer.cancel()
        if killed.is_set():
            pytest.fail(f"engine job still running after {ENGINE_TIMEOUT_S} s: killed ({log_file})")
        return status

    def _reply(self, log_file: Path) -> int:
        line = self.server.stdout.readline()
        if not line:
            pytest.fail(f"the engine fork server ended (exit {self.server.wait()}) during {log_file}")
        return json.loads(line)


ENGINE_FORKS = EngineForks()


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
    """Run ``engine_job.py`` on ``job`` (a fork of ``ENGINE_FORKS``; a fresh process where ``env``
    adds settings); fail the test with the engine's log on error, and on any traceback in that log."""
    workdir.mkdir(parents=True, exist_ok=True)
    job_file, out_file, log_file = workdir / "job.json", workdir / "out.json", workdir / "engine.log"
    job_file.write_text(json.dumps(job))
    if env:  # settings vLLM may read as it is imported: a fresh process
        with open(log_file, "w") as log:
            returncode = subprocess.run(
                [sys.executable, str(ENGINE_JOB), str(job_file), str(out_file)], stdout=log,
                stderr=subprocess.STDOUT, env={**engine_env(), **env}, timeout=ENGINE_TIMEOUT_S).returncode
    else:
        returncode = ENGINE_FORKS.run(job_file, out_file, log_file)
    if returncode != 0:
        tail = log_file.read_text()[-6000:]
        pytest.fail(f"engine job failed (exit {returncode}); log tail:\n{tail}")
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
