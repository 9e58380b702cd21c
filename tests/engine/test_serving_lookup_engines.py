"""Prompt lookup beside the drafter (``"prompt_lookup_min"``/``"prompt_lookup_max"`` with
``"method": "edsd"``, the drafter held to ``"num_drafter_tokens"`` below K) in a real engine, at
T=0: output identical to the target's alone; both sources draft, the drafter within its own
length; the counts per source add up to vLLM's own spec-decode counters; a request capped at 0
gets no drafts from either source, and capped ones no more than their cap.
Unit tests of the matcher, the rule and the config: tests/unit/test_serving_lookup.py."""

from __future__ import annotations

import pytest
from support.drafters import edsd_spec
from support.engine_runs import capped_phase, greedy_phase, per_request_metrics
from support.prompts import CAPS, FITTED_TOKENS

K = 4
DRAFTER_TOKENS = 2
LOOKUP_KEYS = {"prompt_lookup_min": 2, "prompt_lookup_max": 4, "num_drafter_tokens": DRAFTER_TOKENS}
COUNTED = ("chat", "repeats", "repeats-off", "capped")


def counted(phase: dict) -> dict:
    return {**phase, "draft_sources": True}


@pytest.fixture(scope="module")
def lookup_run(trained, engine_runs) -> dict:
    """One engine, four phases: the chat prompts (their no-speculation output is the shared
    reference), each prompt said twice (so the reply can copy it), the same twice-said prompts
    with every request capped at 0 (the target's own output, in this engine), and the chat
    prompts under mixed per-request caps."""
    repeats = [prompt + prompt for prompt in trained["prompts"]]
    job = {"target": trained["target"], "speculative_config": edsd_spec(trained["edsd"], K, **LOOKUP_KEYS),
           "llm_kwargs": {"enforce_eager": True, "dtype": "float32",
                          **({"per_request_spec_decode_metrics": "detailed"} if per_request_metrics() else {})},
           "phases": [counted(greedy_phase("chat", trained["prompts"], FITTED_TOKENS)),
                      counted(greedy_phase("repeats", repeats, FITTED_TOKENS)),
                      counted(capped_phase("repeats-off", repeats, [0] * len(repeats), FITTED_TOKENS)),
                      counted(capped_phase("capped", trained["prompts"], CAPS, FITTED_TOKENS))]}
    return engine_runs("fitted-edsd-lookup", job)["phases"]


def test_greedy_output_is_the_targets(lookup_run, plain_outputs):
    assert lookup_run["chat"]["outputs"] == plain_outputs
    assert lookup_run["capped"]["outputs"] == plain_outputs
    assert lookup_run["repeats"]["outputs"] == lookup_run["repeats-off"]["outputs"]


def test_lookup_and_drafter_both_draft(lookup_run):
    for name in ("chat", "repeats"):
        sources = lookup_run[name]["draft_sources"]
        assert sources["lookup"]["draft_tokens"] > 0 and sources["drafter"]["draft_tokens"] > 0, (name, sources)
        assert sources["lookup"]["accepted"] > 0 and sources["drafter"]["accepted"] > 0, (name, sources)


def test_the_drafter_drafts_within_its_own_length_and_the_lookup_beyond_it(lookup_run):
    for name in ("chat", "repeats", "capped"):
        drafter = lookup_run[name]["draft_sources"]["drafter"]
        assert 0 < drafter["draft_tokens"] <= DRAFTER_TOKENS * drafter["drafts"], (name, drafter)
    lookup = lookup_run["repeats"]["draft_sources"]["lookup"]
    assert lookup["draft_tokens"] > DRAFTER_TOKENS * lookup["drafts"], lookup  # a copied reply: long matches


@pytest.mark.parametrize("name", COUNTED)
def test_counts_per_source_add_up_to_vllms_counters(lookup_run, name):
    phase = lookup_run[name]
    sources, counters = phase["draft_sources"], phase["counters"]
    assert sum(s["draft_tokens"] for s in sources.values()) == counters["draft_tokens"], (sources, counters)
    assert sum(s["accepted"] for s in sources.values()) == counters["accepted"], (sources, counters)


def test_a_request_capped_at_0_gets_no_drafts_from_either_source(lookup_run):
    phase = lookup_run["repeats-off"]
    assert phase["counters"]["draft_tokens"] == 0
    assert all(s == {"drafts": 0, "draft_tokens": 0, "accepted": 0} for s in phase["draft_sources"].values())


def test_no_request_drafts_beyond_its_cap(lookup_run):
    """vLLM's own per-request metrics: no verify step of a capped request checked more drafts
    than its cap, from either source."""
    if not per_request_metrics():
        pytest.skip("this vLLM has no per-request spec-decode metrics")
    for cap, metrics in zip(CAPS, lookup_run["capped"]["request_metrics"], strict=True):
        assert metrics is not None, "no per-request metrics reported"
        assert max(metrics.get("per_step_drafted") or [0]) <= (K if cap is None else cap), (cap, metrics)
