"""What the test session builds once for all of pytest-xdist's workers, and where their engines run.

``scripts/test.sh`` runs each tier with two xdist workers (``-n 2 --dist loadfile``): a vLLM
engine on a CPU computes on one core, so a second worker uses the core the first leaves idle.
Every worker is a process with its own session, so a session fixture would be built once per
worker and a shared engine started once per worker. ``build_once`` builds it in the directory
all workers of the run share, under a file lock: the first worker to ask builds it, the others
wait for it and read what it built. Without xdist it is an ordinary build.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from filelock import FileLock

T = TypeVar("T")
WORKER = os.environ.get("PYTEST_XDIST_WORKER")  # "gw0", "gw1", ... under xdist, else None


def shared_root(tmp_path_factory) -> Path:
    """The run's directory that every worker sees (a worker's own base is one level below it)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if WORKER else base


def build_once(tmp_path_factory, name: str, build: Callable[[Path], T]) -> T:
    """``build(directory)``'s result, built by one worker of the run and read by the others
    (pickled beside the directory). A build that fails leaves nothing: the next worker that
    asks builds it again and fails with its own error."""
    root = shared_root(tmp_path_factory)
    done = root / f"{name}.pickle"
    with FileLock(str(root / f"{name}.lock")):
        if done.exists():
            return pickle.loads(done.read_bytes())
        directory = root / name
        directory.mkdir(parents=True, exist_ok=True)
        result = build(directory)
        done.write_bytes(pickle.dumps(result))
        return result


# GiB of KV cache per engine (vLLM's CPU setting, which overrides ``kv_cache_memory_bytes``): the
# CPU build's default, a quarter of the node's memory, took 19 s of an eager toy engine's 40-s start
# to allocate (5.2 GiB) on a 2-core AMD EPYC (AVX512-BF16, float32), 1 GiB 3 s; 1 GiB holds 23,000
# tokens of the demo target in float32, more than any test's batch needs.
TEST_KV_CACHE_GIB = "1"


def configure_test_engines() -> None:
    """Settings that every engine process this worker's tests start inherits:

    * a KV cache of ``TEST_KV_CACHE_GIB`` (``VLLM_CPU_KVCACHE_SPACE``), with or without xdist;
    * a core of its own (``VLLM_CPU_OMP_THREADS_BIND``): vLLM's automatic binding puts every
      engine's threads on the same core, so two workers' engines would share one core and leave
      the other idle. Tests that need another binding (tensor parallelism) set their own;
    * a compile cache of its own (``VLLM_CACHE_ROOT``): two engines compiling the same model at
      once would write the same cache entry while the other reads it."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", TEST_KV_CACHE_GIB)
    if WORKER is None:
        return
    index = int(WORKER.removeprefix("gw"))
    if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ and hasattr(os, "sched_getaffinity"):
        cpus = sorted(os.sched_getaffinity(0))
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(cpus[index % len(cpus)])
    if "VLLM_CACHE_ROOT" not in os.environ:
        os.environ["VLLM_CACHE_ROOT"] = str(Path.home() / ".cache" / "vllm" / f"test-worker-{index}")
