"""Shared fixtures: tiny models built on the spot and real vLLM engines run as jobs.

vLLM engine start-up costs ~35 s on the CI machine, so each engine configuration is
started once per session (session-scoped fixtures) and every test that needs it reads the
job's recorded results. What the fixtures build, run and share with the tests lives in
tests/support/; this file holds only fixtures and pytest hooks.
"""

from __future__ import annotations

import pytest
from support.builds import (
    build_broken_drafters,
    build_massive_activation,
    build_models,
    build_parity_drafters,
    train_on_fitted,
)
from support.engine_runs import greedy_phase, run_engine_job, serve_fitted
from support.prompts import SHARED_PREFIX_PROMPTS, SHARED_PREFIX_TOKENS
from support.shared import build_once, configure_test_engines
from support.toy import make_target


def pytest_configure(config):
    """Before any test module is collected: this worker's engines get a small KV cache, and a core
    and a compile cache of their own."""
    configure_test_engines()


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> dict:
    """Toy targets (Llama, Qwen3) and EDSD drafters for them, in vLLM's layout."""
    return build_once(tmp_path_factory, "models", build_models)


@pytest.fixture(scope="session")
def massive_activation(tmp_path_factory) -> dict:
    """A toy target whose first token carries 30,000 on one dimension (as SmolLM2-135M's carries
    about 24,800), and an EDSD drafter whose fed-back state grows about tenfold per step: their
    float32 values pass float16's 65,504 at every draft step (tests/unit/test_methods_float16.py)."""
    return build_once(tmp_path_factory, "massive-activation", build_massive_activation)


@pytest.fixture(scope="session")
def fitted_target(tmp_path_factory) -> str:
    """A toy target fitted to the toy corpus: its greedy text is text-like and partly
    memorised, so regenerated answers round-trip through the tokenizer and a drafter has
    something to learn (a random-weight target has neither)."""
    return build_once(tmp_path_factory, "fitted", lambda root: str(make_target(root / "target", seed=3,
                                                                               train_steps=300)))


@pytest.fixture(scope="session")
def trained(fitted_target, tmp_path_factory) -> dict:
    """The user's path on the fitted target: ``edsd select``, ``edsd train`` (EDSD and the
    EAGLE-3 baseline, regenerated data) and ``edsd convert`` (unfolded and folded). The trained
    drafters' proposals depend on every weight and are often accepted, so serving tests that
    use them fail when a layer is mis-sharded or mis-loaded."""
    return build_once(tmp_path_factory, "pipeline", lambda root: train_on_fitted(fitted_target, root))


@pytest.fixture(scope="module")
def drafters(models, tmp_path_factory) -> dict[str, str]:
    """Broken variants of the toy drafter, one defect each."""
    return build_broken_drafters(models, tmp_path_factory.mktemp("bad-drafters"))


@pytest.fixture(scope="session")
def parity_drafters(models, tmp_path_factory) -> dict:
    """Drafters whose drafts depend on every weight (random, token norms too), one per token
    norm, each converted unfolded and folded: ``{(norm, folded): (served dir, source dir)}``,
    one with Llama-3.1's RoPE scaling, ``{"llama3-rope": ...}``, and EAGLE 3.1's (EAGLE-3
    drafters for vLLM's own ``eagle3``, ``builds.EAGLE31_DRAFTERS``).
    The RMSNorm one is a SpecForge checkpoint (sharded, with its own copy of the embedding),
    the LayerNorm one this project's training layout."""
    return build_once(tmp_path_factory, "parity", lambda root: build_parity_drafters(models, root))


@pytest.fixture(scope="session")
def engine_runs(tmp_path_factory):
    """Memoised engine jobs: ``engine_runs(key, job)`` runs each key once per test run (once for
    all xdist workers)."""
    cache: dict[str, dict] = {}

    def run(key: str, job: dict, env: dict | None = None) -> dict:
        if key not in cache:
            cache[key] = build_once(tmp_path_factory, f"engine-{key}",
                                    lambda workdir: run_engine_job(job, workdir, env))
        return cache[key]

    return run


@pytest.fixture(scope="session")
def plain_outputs(trained, engine_runs) -> list[list[int]]:
    """The fitted target's greedy outputs of ``trained["prompts"]`` without speculation."""
    return serve_fitted(trained, engine_runs, "pipeline-none", None)["outputs"]


@pytest.fixture(scope="session")
def baseline(models, engine_runs):
    """Greedy outputs of each toy target without speculation: of PROMPTS (phase ``greedy``) and
    of SHARED_PREFIX_PROMPTS (``shared-prefix``)."""

    def outputs(arch: str, phase: str = "greedy") -> list[list[int]]:
        job = {
            "target": models[arch],
            "llm_kwargs": {"enforce_eager": True, "dtype": "float32"},
            "phases": [greedy_phase(), greedy_phase("shared-prefix", SHARED_PREFIX_PROMPTS, SHARED_PREFIX_TOKENS)],
        }
        return engine_runs(f"baseline-{arch}", job)["phases"][phase]["outputs"]

    return outputs


# The engine tier's longest files (about 3 to 10 minutes each on the CI machine, measured), run
# first: two workers take one file at a time (``--dist loadfile``), so a long file taken last
# keeps one worker busy while the other has nothing left to do.
LONGEST_FIRST = ("test_serving_engines", "test_bench_suites", "test_serving_dtypes", "test_serving_sampling",
                 "test_serving_adaptive_length", "test_serving_load")


def longest_first(item) -> int:
    name = item.path.stem
    return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)


def pytest_collection_modifyitems(config, items):
    """The longest files first, each file's tests in their order. Tests marked ``gpu`` need
    CUDA (``bash scripts/test_gpu.sh`` on a GPU machine): skipped where torch sees no GPU."""
    items.sort(key=longest_first)  # stable: the other files keep their order
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if gpu:
        import torch

        if not torch.cuda.is_available():
            for item in gpu:
                item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
