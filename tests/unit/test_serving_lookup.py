"""Prompt lookup beside the drafter (``serving/features/lookup.py``): the n-gram matcher against
vLLM's own, the choice rule, tokens so far as the runner holds them, the drafts and draft
probabilities handed on, counting by source, the speculative config's keys on vLLM's own
config path, and the bench's ``edsd+lookup``. The engine test: tests/engine/test_serving_lookup_engines.py."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from support.drafters import edsd_spec as spec
from support.drafters import engine_config

from vllm_edsd.errors import EDSDError
from vllm_edsd.serving.features.draft_length import check_runner
from vllm_edsd.serving.features.lookup import (
    DRAFTER,
    FEATURE,
    LOOKUP,
    LookupDrafting,
    Match,
    PromptLookup,
    find_match,
    one_hot_rows,
    use_lookup,
)


def tokens(*ids: int) -> np.ndarray:
    return np.array(ids, dtype=np.int32)


@pytest.mark.parametrize(("context", "expected"), [
    ((5, 6, 7, 8, 5, 6), Match(2, [7, 8, 5, 6])),  # the bigram 5 6 occurred at the start
    ((1, 5, 6, 7, 2, 5, 6, 9, 3, 5, 6), Match(2, [7, 2, 5, 6])),  # its earliest occurrence
    ((1, 2, 3, 9, 2, 3, 8, 1, 2, 3), Match(3, [9, 2, 3, 8])),  # the longest n wins over a later shorter one
    ((4, 4, 4, 4), Match(3, [4])),  # an occurrence may overlap the end; what follows it is the draft
    ((1, 2, 3, 4), None),  # no earlier occurrence
    ((7, 1, 9, 1), None),  # a one-token match is below min_n
    ((), None),
])
def test_the_matcher_finds_the_longest_earliest_ngram(context, expected):
    assert find_match(tokens(*context), 2, 3, 4) == expected


def test_the_matcher_proposes_at_most_k_tokens_and_nothing_for_k_0():
    context = tokens(1, 2, 3, 4, 5, 6, 1, 2)
    assert find_match(context, 2, 4, 3) == Match(2, [3, 4, 5])
    assert find_match(context, 2, 4, 0) is None


def test_the_matcher_drafts_what_vllms_ngram_proposer_drafts():
    """Random short sequences over small alphabets (many overlapping matches) against vLLM's
    own matcher, where this vLLM has it under that name."""
    ngram = pytest.importorskip("vllm.v1.spec_decode.ngram_proposer")
    reference = getattr(ngram, "_find_longest_matched_ngram_and_propose_tokens", None)
    if reference is None:
        pytest.skip("this vLLM's n-gram matcher has another name")
    rng = np.random.default_rng(0)
    for _ in range(2000):
        context = rng.integers(0, int(rng.integers(1, 6)), int(rng.integers(0, 40))).astype(np.int32)
        low = int(rng.integers(1, 4))
        high, k = low + int(rng.integers(0, 3)), int(rng.integers(1, 6))
        match = find_match(context, low, high, k)
        expected = reference(context, low, high, 10**6, k).tolist()
        assert ([] if match is None else match.tokens) == expected, (context.tolist(), low, high, k)


def test_the_rule_picks_the_lookup_where_it_matched_at_least_min_tokens():
    settings = PromptLookup(2, 4)
    assert use_lookup(Match(2, [1]), settings) and use_lookup(Match(4, [1, 2]), settings)
    assert not use_lookup(Match(1, [1]), settings)
    assert not use_lookup(Match(3, []), settings)
    assert not use_lookup(None, settings)


@pytest.mark.parametrize(("fields", "expected"), [
    ({}, None),
    ({"prompt_lookup_min": None, "prompt_lookup_max": None}, None),
    ({"prompt_lookup_min": 2, "prompt_lookup_max": 4}, PromptLookup(2, 4)),
    ({"prompt_lookup_min": 3}, PromptLookup(3, 3)),  # one key alone sets both, as vLLM's ngram does
    ({"prompt_lookup_max": 3}, PromptLookup(3, 3)),
    ({"prompt_lookup_min": 2, "prompt_lookup_max": 4, "num_drafter_tokens": 1}, PromptLookup(2, 4, 1)),
])
def test_the_keys_are_taken_out_of_the_config(fields, expected):
    fields = {**fields, "model": "x"}
    assert PromptLookup.pop_from(fields) == expected
    assert fields == {"model": "x"}


@pytest.mark.parametrize(("fields", "message"), [
    ({"prompt_lookup_min": 0, "prompt_lookup_max": 4},
     "'prompt_lookup_min' \\(an n-gram length .* must be a positive integer, got 0"),
    ({"prompt_lookup_min": 2, "prompt_lookup_max": -1},
     "'prompt_lookup_max' \\(an n-gram length .* must be a positive integer, got -1"),
    ({"prompt_lookup_min": True, "prompt_lookup_max": 4}, "'prompt_lookup_min' .* got True"),
    ({"prompt_lookup_min": 2.0, "prompt_lookup_max": 4}, "'prompt_lookup_min' .* got 2.0"),
    ({"prompt_lookup_max": "3"}, "'prompt_lookup_max' .* got '3'"),
    ({"prompt_lookup_min": 5, "prompt_lookup_max": 4},
     r"'prompt_lookup_min' \(5\) must not exceed 'prompt_lookup_max' \(4\)"),
    ({"num_drafter_tokens": 1}, "'num_drafter_tokens' limits the drafter beside the prompt lookup: it needs"),
    ({"prompt_lookup_max": 3, "num_drafter_tokens": 0}, "'num_drafter_tokens' .* must be a positive integer, got 0"),
    ({"prompt_lookup_max": 3, "num_drafter_tokens": 1.0}, "'num_drafter_tokens' .* got 1.0"),
])
def test_bad_keys_are_one_line_naming_the_key(fields, message):
    with pytest.raises(EDSDError, match=message) as err:
        PromptLookup.pop_from(fields)
    assert "\n" not in str(err.value)


def fake_runner(contexts: list[list[int]], **extra) -> SimpleNamespace:
    """The parts of vLLM's V1 runner the lookup reads: the token buffer, each row's count of
    tokens without drafts, the vocabulary and the context limit."""
    buffer = np.zeros((len(contexts), 64), dtype=np.int32)
    for i, context in enumerate(contexts):
        buffer[i, :len(context)] = context
    batch = SimpleNamespace(token_ids_cpu=buffer, num_tokens_no_spec=np.array([len(c) for c in contexts]),
                            vocab_size=100, req_ids=[f"r{i}" for i in range(len(contexts))])
    return SimpleNamespace(input_batch=batch, max_model_len=64, **extra)


def arguments(sampled, num_draft_tokens=None, k=4) -> dict:
    metadata = None if num_draft_tokens is None else SimpleNamespace(num_draft_tokens=num_draft_tokens)
    return {"sampled_token_ids": sampled, "spec_decode_metadata": metadata,
            "scheduler_output": SimpleNamespace(num_spec_tokens_to_schedule=k)}


def test_tokens_so_far_include_this_steps_tokens_before_and_after_bookkeeping():
    """Before the runner's bookkeeping (a tensor: EAGLE's padded batch) this step's accepted
    tokens are not in the buffer yet and rejected slots are -1; after it (lists) they are."""
    lookup = LookupDrafting(PromptLookup(2, 4))
    # row 0 ends in "3 4" once 4 (accepted) is added: a match; row 1's 9 is rejected (-1)
    before = fake_runner([[3, 4, 5, 6, 7, 3], [1, 2, 8, 1]])
    matches = lookup.before_drafting(before, arguments(torch.tensor([[4, -1], [2, -1]])), [4, 4])
    assert matches == [Match(2, [5, 6, 7, 3]), Match(2, [8, 1, 2])]
    after = fake_runner([[3, 4, 5, 6, 7, 3, 4], [1, 2, 8, 1, 2]])
    assert lookup.before_drafting(after, arguments([[4], [2]]), [4, 4]) == matches


def test_caps_and_this_steps_k_cut_the_lookups_drafts():
    lookup = LookupDrafting(PromptLookup(2, 4))
    contexts = [[3, 4, 5, 6, 7, 3, 4]] * 3
    runner = fake_runner(contexts)
    assert lookup.before_drafting(runner, arguments([[4]] * 3), [0, 1, 4]) == [None, Match(2, [5]),
                                                                              Match(2, [5, 6, 7, 3])]
    assert lookup.before_drafting(runner, arguments([[4]] * 3, k=2), [4, 4, 4]) == [Match(2, [5, 6])] * 3
    assert lookup.before_drafting(runner, arguments([[], [4], [4]]), [4, 4, 4])[0] is None  # a partial prefill


def test_lookup_rows_take_the_lookups_drafts_and_the_next_step_counts_by_source():
    lookup = LookupDrafting(PromptLookup(2, 4))
    runner = fake_runner([[3, 4, 5, 3, 4], [1, 2, 3, 5, 6]], _draft_probs=None)
    matches = [Match(2, [5, 3, 4]), None]
    drafts = lookup.after_drafting(runner, [[], [7, 8]], matches)
    assert drafts == [[5, 3, 4], [7, 8]]
    assert lookup.sources == {"r0": LOOKUP, "r1": DRAFTER}
    # next step: r0's 3 drafts, 2 accepted (3 tokens kept); r1's 2 drafts, none accepted
    lookup.count_verified(["r0", "r1"], [3, 2], [[5, 3, 9], [4]])
    assert lookup.counts.as_dict() == {LOOKUP: {"drafts": 1, "draft_tokens": 3, "accepted": 2},
                                       DRAFTER: {"drafts": 1, "draft_tokens": 2, "accepted": 0}}
    untouched = torch.tensor([[1, 2], [3, 4]])
    assert lookup.after_drafting(runner, untouched, [None, None]) is untouched  # the drafter's own, as vLLM made it
    assert lookup.sources == {"r0": DRAFTER, "r1": DRAFTER}


def test_the_drafter_drafts_within_its_own_length_where_the_lookup_does_not():
    """Lookup rows: drafter cap 0; drafter rows: their request's cap within ``num_drafter_tokens``;
    None where every row is left at K, so that vLLM's own draft loop runs."""
    match = Match(2, [5, 6, 7])
    capped = LookupDrafting(PromptLookup(2, 4, drafter_tokens=1))
    assert capped.drafter_caps([None, match, None], [4, 4, 0], k=4) == [1, 0, 0]
    assert capped.drafter_caps([None], [4], k=1) is None  # K=1 is the drafter's length already
    plain = LookupDrafting(PromptLookup(2, 4))
    assert plain.drafter_caps([None, match], [4, 2], k=4) == [4, 0]
    assert plain.drafter_caps([None, None], [4, 4], k=4) is None


def test_lookup_rows_get_one_hot_draft_probabilities_widened_to_their_drafts():
    """Where the drafter's probabilities are kept for the rejection sampler (sampled drafts),
    a lookup row's are one-hot on its tokens, even where the drafter stopped after one step."""
    probs = torch.full((2, 1, 5), 0.2)
    widened = one_hot_rows(probs, [Match(2, [3, 1, 4]), None])
    assert widened.shape == (2, 3, 5)
    assert widened[0].argmax(dim=-1).tolist() == [3, 1, 4] and widened[0].sum().item() == 3
    assert torch.equal(widened[1, :1], probs[1])


@pytest.mark.parametrize("method", ["edsd", "eagle3"])
def test_the_keys_reach_the_workers_on_vllms_own_config(models, method):
    """vLLM zeroes the keys for model drafters; the plugin puts them back on the config that
    travels to the workers, for EDSD and vLLM's own EAGLE-3 alike; without them nothing changes."""
    import pickle

    request = {**spec(models["llama-edsd"], prompt_lookup_min=2, prompt_lookup_max=4), "method": method}
    config = pickle.loads(pickle.dumps(engine_config(models["llama"], request)))
    assert config.speculative_config.method == "eagle3"
    assert PromptLookup.of(config.speculative_config) == PromptLookup(2, 4)
    plain = engine_config(models["llama"], {**spec(models["llama-edsd"]), "method": method})
    assert PromptLookup.of(plain.speculative_config) is None


def test_a_bad_key_is_refused_before_any_engine_starts(models):
    with pytest.raises(EDSDError, match="^speculative config: 'prompt_lookup_min' \\(3\\) must not exceed"):
        engine_config(models["llama"], spec(models["llama-edsd"], prompt_lookup_min=3, prompt_lookup_max=2))
    with pytest.raises(EDSDError, match="^speculative config: 'num_drafter_tokens' \\(5\\) must not exceed "
                                        "num_speculative_tokens \\(4\\)"):
        engine_config(models["llama"], spec(models["llama-edsd"], k=4, prompt_lookup_max=3, num_drafter_tokens=5))


@pytest.mark.parametrize("method", ["edsd", "eagle3"])
def test_the_drafters_length_reaches_the_workers(models, method):
    import pickle

    request = {**spec(models["llama-edsd"], k=4, prompt_lookup_max=3, num_drafter_tokens=1), "method": method}
    config = pickle.loads(pickle.dumps(engine_config(models["llama"], request)))
    assert PromptLookup.of(config.speculative_config) == PromptLookup(3, 3, 1)


def test_the_lookup_needs_the_v1_runner_and_synchronous_scheduling(models):
    config = engine_config(models["llama"], spec(models["llama-edsd"], prompt_lookup_min=2))
    check_runner(FEATURE, config)
    config.scheduler_config.async_scheduling = True
    with pytest.raises(EDSDError, match="prompt lookup beside the drafter .* needs synchronous scheduling"):
        check_runner(FEATURE, config)


def test_the_bench_serves_edsd_with_lookup_as_the_ngram_baselines_lengths():
    from bench.offline import TRAINING_FREE, Setup, method_config

    setup = Setup(target="t", drafters={"edsd": "d"}, methods=["edsd+lookup"], ks=[4], prompts_per_category=1,
                  max_tokens=8, batch_sizes=[1])
    config = method_config(setup, "edsd+lookup", 4)
    assert config == {"method": "edsd", "model": "d", "num_speculative_tokens": 4, **TRAINING_FREE["ngram"]}
    assert config["prompt_lookup_min"] == 2 and config["prompt_lookup_max"] == 4


@pytest.mark.parametrize("method", ["edsd", "eagle3"])
def test_the_bench_serves_either_drafter_with_lookup_and_at_one_token(method):
    """``METHOD+lookup`` and ``METHOD-k1+lookup`` for both drafters: the race of the two methods
    beside the lookup, the drafter drafting up to K and one token where the lookup does not match."""
    from bench.offline import TRAINING_FREE, Setup, method_config

    setup = Setup(target="t", drafters={method: "d"}, methods=[f"{method}+lookup", f"{method}-k1+lookup"], ks=[4],
                  prompts_per_category=1, max_tokens=8, batch_sizes=[1])
    base = {"method": method, "model": "d", "num_speculative_tokens": 4, **TRAINING_FREE["ngram"]}
    assert method_config(setup, f"{method}+lookup", 4) == base
    assert method_config(setup, f"{method}-k1+lookup", 4) == {**base, "num_drafter_tokens": 1}
