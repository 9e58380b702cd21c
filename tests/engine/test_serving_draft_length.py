"""A request's own draft length (``SamplingParams.extra_args["num_speculative_tokens"]``, the
server's ``vllm_xargs``) in real engines: a mixed batch at T=0 is the target's own output,
every request drafts exactly its cap at every step while the others keep K, and vLLM's
counters are the reference's replay under those caps. With the adaptive rule:
``test_serving_adaptive_length.py``; through the server: ``test_serving_server.py``."""

from __future__ import annotations

import pytest
from support.drafters import edsd_spec
from support.engine_checks import assert_counters_match, predicted_counters
from support.engine_runs import capped_phase, per_request_metrics
from support.prompts import CAPS, FITTED_TOKENS

K = 4


@pytest.fixture(scope="module")
def capped_run(trained, engine_runs) -> dict:
    job = {"target": trained["target"], "speculative_config": edsd_spec(trained["edsd"], K),
           "llm_kwargs": {"enforce_eager": True, "dtype": "float32",
                          **({"per_request_spec_decode_metrics": "detailed"} if per_request_metrics() else {})},
           "phases": [capped_phase("mixed", trained["prompts"], CAPS, FITTED_TOKENS),
                      capped_phase("all-off", trained["prompts"], [0] * len(CAPS), FITTED_TOKENS)]}
    return engine_runs("fitted-edsd-capped", job)["phases"]


def caps_or_k(caps: list[int | None]) -> list[int]:
    return [K if cap is None else cap for cap in caps]


@pytest.mark.vllm_range
def test_mixed_batch_is_the_targets_output(capped_run, plain_outputs):
    assert capped_run["mixed"]["outputs"] == plain_outputs
    assert capped_run["all-off"]["outputs"] == plain_outputs
    assert capped_run["all-off"]["counters"]["drafts"] == capped_run["all-off"]["counters"]["draft_tokens"] == 0


@pytest.mark.vllm_range
def test_each_request_drafts_its_cap_and_the_others_keep_k(capped_run):
    """Every recorded draft step: each row's draft is exactly its request's cap long (an
    uncapped request: K), in a batch that holds every cap at once."""
    steps = capped_run["mixed"]["batch_steps"]
    assert steps, "no draft step was recorded"
    for rows in steps:
        for cap, draft in rows:
            assert len(draft) == (K if cap is None else cap), rows
    assert any({cap for cap, _ in rows} == set(CAPS) for rows in steps), "no step held every cap"


def test_per_request_metrics_count_each_requests_cap(capped_run):
    """vLLM's own per-request spec-decode metrics: every verify step of a request drafted
    exactly its cap, and a request capped at 0 drafted nothing."""
    if not per_request_metrics():
        pytest.skip("this vLLM has no per-request spec-decode metrics")
    for cap, metrics in zip(caps_or_k(CAPS), capped_run["mixed"]["request_metrics"], strict=True):
        assert metrics is not None, "no per-request metrics reported"
        assert metrics["num_draft_tokens"] == cap * metrics["num_spec_steps"], (cap, metrics)
        assert set(metrics.get("per_step_drafted", [])) == ({cap} if cap else set()), (cap, metrics)


@pytest.mark.vllm_range
def test_counters_are_the_replay_under_the_caps(trained, capped_run):
    """vLLM's spec-decode counters equal the reference model's replay of each request's
    chains cut to its cap (a request capped at 0 counts no draft)."""
    measured = capped_run["mixed"]["counters"]
    predicted = predicted_counters(trained, capped_run["mixed"]["outputs"], K, caps=caps_or_k(CAPS))
    assert_counters_match(predicted, measured)
    assert predicted.draft_tokens == pytest.approx(measured["draft_tokens"], rel=0.02)
    assert measured["draft_tokens"] < K * measured["drafts"]
