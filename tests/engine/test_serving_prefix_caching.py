"""Prefix caching and chunked prefill under per-request draft lengths (caps, and opt-outs at 0),
on prompts that share long prefixes (``SHARED_PREFIX_PROMPTS``), against the target's own output.

Prefix caching, on by vLLM's default, in the shared eager EDSD engine (``llama_edsd_eager``),
one request at a time, a prefix first computed by a request that opted out of drafting. An
opted-out request alone runs no drafter forward, so its blocks lack the drafter's KV: it gets
its own prefix-cache salt, and a drafting request hits only blocks that drafting requests
computed. vLLM reports exactly those hits, the output is the target's, and every chain is the
reference model's cut to its request's cap (a drafting request that reused an opted-out one's
blocks would draft from an unwritten drafter KV cache).

Chunked prefill, in an engine of its own (a prefill budget of 40 tokens, smaller than every
prompt; prefix caching on, in blocks of 32): the output is the target's and every request drafts
its cap, alone and in a batch. Its chains are not the reference's: vLLM 0.32 gives the drafter a
wrong token at the end of every chunk of a prompt but the last, for its own EAGLE-3 too with the
plugin not loaded (docs/known-issues.md); a strict xfail says when that changes."""

from __future__ import annotations

import pytest
from support.drafters import edsd_spec
from support.engine_checks import assert_drafts_match, reference_chains
from support.engine_runs import capped_phase, llama_edsd_eager
from support.prompts import SHARED_PREFIX_CAPS, SHARED_PREFIX_PROMPTS, SHARED_PREFIX_TOKENS, SHARED_PREFIXES

K = 4
BATCH_CAPS = [None, 0, 1, None, 2, 0]  # the same prompts at once, every prefix cached by now
CHUNKED = {"enforce_eager": True, "dtype": "float32", "enable_prefix_caching": True, "enable_chunked_prefill": True,
           "max_num_batched_tokens": 40, "max_num_seqs": 8, "block_size": 32}


@pytest.fixture(scope="module")
def cached(models, engine_runs) -> dict:
    return llama_edsd_eager(models, engine_runs)["phases"]["shared-prefix"]


@pytest.fixture(scope="module")
def chunked(models, engine_runs) -> dict:
    phases = [capped_phase("alone", SHARED_PREFIX_PROMPTS, SHARED_PREFIX_CAPS, SHARED_PREFIX_TOKENS, alone=True),
              capped_phase("batch", SHARED_PREFIX_PROMPTS, BATCH_CAPS, SHARED_PREFIX_TOKENS)]
    job = {"target": models["llama"], "speculative_config": edsd_spec(models["llama-edsd"], K), "llm_kwargs": CHUNKED,
           "phases": phases}
    return engine_runs("llama-edsd-chunked-prefill", job)["phases"]


def expected_hits(prompts: list, caps: list) -> list[bool]:
    """Which requests, run one at a time in order, find their prefix cached: those after a
    request of the same prefix on the same side of drafting (capped at 0 or not)."""
    prefix = len(SHARED_PREFIXES[0])
    return [any(p[:prefix] == prompts[i][:prefix] and (c == 0) == (caps[i] == 0) for p, c in zip(prompts[:i], caps[:i]))
            for i in range(len(prompts))]


def assert_hits(phase: dict) -> None:
    """Each request finds at least 64 prompt tokens cached where ``expected_hits`` says so and
    none elsewhere (with a drafter vLLM recomputes the last block found: its drafter KV needs
    the target's hidden states), and vLLM's counters report the hits."""
    hits = expected_hits(SHARED_PREFIX_PROMPTS, SHARED_PREFIX_CAPS)
    assert hits == [False, False, False, True, False, True]  # the caps make both kinds of miss and hit
    cached = phase["cached_tokens"]
    assert all((n >= 64) if hit else n == 0 for n, hit in zip(cached, hits, strict=True)), cached
    assert phase["prefix_cache"]["hits"] >= sum(hits) * 64, phase["prefix_cache"]


def compared_chains(models: dict, phase: dict, caps: list) -> list[int]:
    """How many chains of each request (run alone) equal the reference model's cut to its cap;
    fails at the first that does not."""
    chains_for = reference_chains(models["llama"], models["llama-edsd-training"])
    compared = []
    for prompt, output, recorded, cap in zip(SHARED_PREFIX_PROMPTS, phase["outputs"], phase["proposals"], caps,
                                             strict=True):
        def cut(sequence, n=K if cap is None else cap):
            return [row[:n] for row in chains_for(sequence).tolist()]

        one = {"outputs": [output], "proposals": [recorded]}
        compared.append(assert_drafts_match([prompt], one, cut, K))
    return compared


def test_prefix_caching_is_lossless_and_hit(cached, baseline):
    assert cached["outputs"] == baseline("llama", "shared-prefix")
    assert_hits(cached)


def test_drafts_after_a_hit_are_the_reference_models(models, cached):
    """Every drafting request's chains are the reference's (cut to the cap): those that hit a
    prefix and those that recomputed one an opted-out request had cached."""
    compared = compared_chains(models, cached, SHARED_PREFIX_CAPS)
    assert min(compared[i] for i, cap in enumerate(SHARED_PREFIX_CAPS) if cap != 0) >= SHARED_PREFIX_TOKENS // (K + 1)


def test_an_opted_out_request_alone_runs_no_drafter_forward(cached):
    """A request capped at 0, alone in its steps, skips the drafter (its prefill included);
    every other request runs it."""
    forwards = cached["drafter_forwards"]
    assert len(forwards) == len(SHARED_PREFIX_CAPS), forwards
    assert all((n == 0) == (cap == 0) for n, cap in zip(forwards, SHARED_PREFIX_CAPS, strict=True)), forwards


def test_chunked_prefill_is_lossless_and_each_request_drafts_its_cap(chunked, baseline):
    assert min(map(len, SHARED_PREFIX_PROMPTS)) > CHUNKED["max_num_batched_tokens"]  # every first prefill in chunks
    assert chunked["alone"]["outputs"] == chunked["batch"]["outputs"] == baseline("llama", "shared-prefix")
    assert_hits(chunked["alone"])
    for cap, recorded in zip(SHARED_PREFIX_CAPS, chunked["alone"]["proposals"], strict=True):
        assert recorded and {len(step[0]) for step in recorded} == {K if cap is None else cap}, (cap, recorded)
    steps = chunked["batch"]["batch_steps"]
    assert steps and all(len(draft) == (K if cap is None else cap) for rows in steps for cap, draft in rows), steps
    assert {cap for rows in steps for cap, _ in rows} == set(BATCH_CAPS)


@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="vLLM 0.32 feeds the drafter the prompt's last token at the end of each chunk but the last "
                          "(docs/known-issues.md)")
def test_chunked_prefill_drafts_are_the_reference_models(models, chunked):
    """After a prompt prefilled in chunks, the drafter's KV cache holds, at the end of every
    chunk but the last, the prompt's last token in place of the next one (vLLM's
    ``prepare_next_token_ids_padded``), so every later chain differs from the reference's."""
    compared_chains(models, chunked["alone"], SHARED_PREFIX_CAPS)
