"""An EDSD engine pushed to its limits: a KV cache so small that the scheduler must preempt
running requests, and prompts that end just short of ``max_model_len`` while drafts are in
flight. Output stays the target's own, nothing crashes, and the engine keeps serving."""

from __future__ import annotations

import pytest
from support.engine_checks import drafting_steps, predicted_counters
from support.engine_runs import MAX_MODEL_LEN, SMALL_CACHE, greedy_phase, serve_fitted
from support.prompts import FITTED_TOKENS

K = 4
EDGE_TOKENS = 16


def edge_prompts(trained: dict, plain_outputs: list[list[int]]) -> list[list[int]]:
    """Prompts 1..6 tokens short of max_model_len (real text: the chats and their replies)."""
    text = [t for prompt, output in zip(trained["prompts"], plain_outputs) for t in prompt + output]
    assert len(text) >= MAX_MODEL_LEN
    return [text[: MAX_MODEL_LEN - short] for short in range(1, 7)]


@pytest.fixture(scope="module")
def runs(trained, engine_runs) -> dict:
    """The same phases on the small cache without and with EDSD: crowded (eight requests
    that must preempt), edge (prompts at max_model_len), and crowded again afterwards."""
    plain_outputs = serve_fitted(trained, engine_runs, "pipeline-none", None)["outputs"]
    spec = {"method": "edsd", "model": trained["edsd-folded"], "num_speculative_tokens": K}
    out = {}
    for name, speculative_config in (("plain", None), ("edsd", spec)):
        phases = [
            greedy_phase("crowded", trained["prompts"], max_tokens=FITTED_TOKENS),
            # The edge phase records each draft chain (one request at a time) to show drafts
            # proposed past max_model_len.
            greedy_phase("edge", edge_prompts(trained, plain_outputs), max_tokens=EDGE_TOKENS,
                         record_proposals=speculative_config is not None),
            greedy_phase("after", trained["prompts"], max_tokens=FITTED_TOKENS),
        ]
        job = {"target": trained["target"], "speculative_config": speculative_config,
               "llm_kwargs": {"enforce_eager": True, "dtype": "float32", **SMALL_CACHE}, "phases": phases}
        out[name] = engine_runs(f"faults-{name}", job)["phases"]
    return {"plain_outputs": plain_outputs, **out}


def test_preempted_requests_stay_lossless(trained, runs):
    """Preemption drops a request's KV cache and its pending drafts and recomputes it later;
    the output is the target's own, and the counters are the reference's prediction less at
    most one draft per preemption (the resumed request's first token comes from the
    recomputation, not from verifying a draft)."""
    crowded = runs["edsd"]["crowded"]
    preempted, measured = crowded["preemptions"], crowded["counters"]
    assert preempted > 0, "the cache was large enough: nothing was preempted"
    assert crowded["outputs"] == runs["plain_outputs"]
    predicted = predicted_counters(trained, crowded["outputs"], K)
    assert predicted.drafts - preempted <= measured["drafts"] <= predicted.drafts
    for p, m in zip(predicted.accepted_per_pos, measured["accepted_per_pos"], strict=True):
        assert abs(p - m) <= 0.02 * measured["drafts"] + 1 + preempted  # a lost draft: at most one per position
    assert measured["accepted_per_pos"][0] > 0.05 * measured["drafts"]


def test_prompts_at_max_model_len_with_drafts_in_flight(trained, runs):
    """A request stops at max_model_len however many drafts were proposed past it: some
    recorded chain reaches beyond the limit (context + drafts > max_model_len)."""
    edge = runs["edsd"]["edge"]
    assert [len(out) for out in edge["outputs"]] == list(range(1, 7))
    assert edge["outputs"] == runs["plain"]["edge"]["outputs"]
    assert edge["counters"]["drafts"] > 0
    prompts = edge_prompts(trained, runs["plain_outputs"])
    reach = [context + len(draft) for prompt, output, recorded in zip(prompts, edge["outputs"], edge["proposals"])
             for context, draft, _ in drafting_steps(prompt, output, recorded)]
    assert reach and max(reach) > MAX_MODEL_LEN, f"no draft chain reached past max_model_len: {reach}"


def test_engine_keeps_serving_after_faults(runs):
    assert runs["edsd"]["after"]["outputs"] == runs["plain_outputs"]
    assert runs["edsd"]["after"]["counters"]["drafts"] > 0
