"""The entropy-adaptive draft length (``"adaptive_draft_length": true``) in real engines:
greedy output unchanged alone and in a concurrent batch; every draft cut exactly where the
reference model's entropy says; vLLM's counters count what was verified; a drafter made
uncertain drafts nothing and a confident one drafts K; the OpenAI server with two
data-parallel engine cores; per-request caps under the rule."""

from __future__ import annotations

import math

import pytest
import requests
import torch
from support.drafters import edited_copy
from support.engine_checks import assert_counters_match, assert_drafts_match, predicted_counters
from support.engine_runs import SMALL_CACHE, capped_phase, greedy_phase, serve_fitted
from support.prompts import CAPS, FITTED_TOKENS
from support.servers import SERVER_ARGS, abandon_streams, completion_token_ids, drafting_engines

from vllm_edsd.features.hidden_states import run_target
from vllm_edsd.launch.engine import parse_prometheus_counters
from vllm_edsd.launch.server import running_server
from vllm_edsd.launch.transformers_target import load_target
from vllm_edsd.methods.edsd.model import EDSDDraftModel
from vllm_edsd.training.acceptance import kept_lengths

K = 4


@pytest.fixture(scope="module")
def reference(trained):
    """``chains_for(sequence) -> (chains [T, K], entropy [T, K])`` of the reference model
    loaded from the trained drafter's unfolded conversion."""
    target = load_target(trained["target"])
    drafter = EDSDDraftModel.from_pretrained(trained["edsd"], embed_tokens=target.model.embed_tokens.weight)
    layers = drafter.config.aux_layer_ids

    def chains_for(sequence: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = run_target(target, sequence, layers).features(layers)[:, :-1]
        chains, entropy = drafter.propose_with_entropy(features, sequence[:, 1:], K)
        return chains[0], entropy[0]

    return chains_for


@pytest.fixture(scope="module")
def max_entropy(trained, plain_outputs, reference) -> float:
    """An entropy near the median of the drafts' along the plain greedy outputs, so that the
    rule cuts some chains early, some late and leaves some whole: the middle of the widest gap
    between neighbouring values in the middle fifth, so that float rounding in vLLM's kernels
    cannot move a draft across it."""
    entropies = torch.cat([reference(torch.tensor([p + o]))[1].flatten()
                           for p, o in zip(trained["prompts"], plain_outputs)]).sort().values
    middle = entropies[int(0.4 * len(entropies)):int(0.6 * len(entropies))]
    widest = int((middle[1:] - middle[:-1]).argmax())
    return float(middle[widest] + middle[widest + 1]) / 2


def adaptive_spec(drafter: str, max_entropy: float) -> dict:
    return {"method": "edsd", "model": drafter, "num_speculative_tokens": K, "adaptive_draft_length": True,
            "adaptive_draft_threshold": math.exp(-max_entropy)}


@pytest.fixture(scope="module")
def adaptive_run(trained, engine_runs, max_entropy) -> dict:
    job = {"target": trained["target"], "speculative_config": adaptive_spec(trained["edsd"], max_entropy),
           "llm_kwargs": {"enforce_eager": True, "dtype": "float32"},
           "phases": [greedy_phase("alone", trained["prompts"], FITTED_TOKENS, record_proposals=True),
                      greedy_phase("batch", trained["prompts"], FITTED_TOKENS),
                      capped_phase("capped", trained["prompts"], CAPS, FITTED_TOKENS)]}
    return engine_runs("fitted-edsd-adaptive", job)["phases"]


def test_output_unchanged_alone_and_in_a_batch(adaptive_run, plain_outputs):
    assert adaptive_run["alone"]["outputs"] == plain_outputs
    assert adaptive_run["batch"]["outputs"] == plain_outputs


def test_drafts_are_cut_where_the_entropy_says(trained, adaptive_run, reference, max_entropy):
    """Each drafted chain is the reference chain up to its first token whose entropy exceeds
    the limit; chains of every length from 0 to K occur."""
    def cut_chains(sequence: torch.Tensor) -> list[list[int]]:
        chains, entropy = reference(sequence)
        return [row[:n] for row, n in zip(chains.tolist(), kept_lengths(entropy, max_entropy).tolist())]

    phase = adaptive_run["alone"]
    assert assert_drafts_match(trained["prompts"], phase, cut_chains, K) > 8 * 8
    lengths = {len(step[0]) for recorded in phase["proposals"] for step in recorded}
    assert {0, K} < lengths, lengths


def test_request_caps_and_the_rule_are_one_limit(trained, adaptive_run, max_entropy, plain_outputs):
    """Per-request caps in a batch under the adaptive rule: output unchanged, no draft longer
    than its cap, the rule still cutting below it, and vLLM's counters the reference's replay
    of chains cut by both (``serving/features/draft_length.py``: one mechanism)."""
    phase = adaptive_run["capped"]
    assert phase["outputs"] == plain_outputs
    for rows in phase["batch_steps"]:
        assert all(len(draft) <= (K if cap is None else cap) for cap, draft in rows), rows
    assert any(len(draft) < cap for rows in phase["batch_steps"] for cap, draft in rows if cap), "the rule cut nothing"
    caps = [K if cap is None else cap for cap in CAPS]
    predicted = predicted_counters(trained, phase["outputs"], K, max_entropy, caps)
    assert_counters_match(predicted, phase["counters"])
    assert predicted.draft_tokens == pytest.approx(phase["counters"]["draft_tokens"], rel=0.02)


def test_tensor_parallel_2_cuts_the_same(trained, engine_runs, adaptive_run, max_entropy):
    """At TP=2 both ranks decide every cut from the same gathered logits: the drafts are the
    TP=1 engine's, cut for cut."""
    prompts = trained["prompts"][:3]
    job = {"target": trained["target"], "speculative_config": adaptive_spec(trained["edsd"], max_entropy),
           "llm_kwargs": {"enforce_eager": True, "dtype": "float32", "tensor_parallel_size": 2},
           "phases": [greedy_phase("alone", prompts, FITTED_TOKENS, record_proposals=True)]}
    tp2 = engine_runs("fitted-edsd-adaptive-tp2", job, env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})["phases"]["alone"]
    assert tp2["outputs"] == adaptive_run["alone"]["outputs"][:3]
    assert tp2["proposals"] == adaptive_run["alone"]["proposals"][:3]


@pytest.mark.parametrize("phase", ["alone", "batch"])
def test_counters_count_what_was_verified(trained, adaptive_run, max_entropy, phase):
    """vLLM's counters equal the reference's replay of the cut chains (a step without drafts
    counts no draft), and fewer tokens were drafted than K per draft."""
    measured = adaptive_run[phase]["counters"]
    predicted = predicted_counters(trained, adaptive_run[phase]["outputs"], K, max_entropy)
    assert_counters_match(predicted, measured)
    assert predicted.draft_tokens == pytest.approx(measured["draft_tokens"], rel=0.02)
    assert measured["draft_tokens"] < K * measured["drafts"]


@pytest.fixture(scope="module")
def scaled_drafters(trained, tmp_path_factory) -> dict[str, str]:
    """The trained drafter with its output layer scaled: by 0 every draft distribution is
    uniform (maximal entropy); by 1000 it is all but certain, with the same argmax."""
    root = tmp_path_factory.mktemp("scaled-drafters")

    def scaled(factor: float):
        return lambda tensors: tensors.update({"lm_head.weight": tensors["lm_head.weight"] * factor})

    return {name: str(edited_copy(trained["edsd"], root / name, edit_tensors=scaled(factor)))
            for name, factor in (("uncertain", 0.0), ("confident", 1000.0))}


def test_uncertain_drafter_drafts_nothing_and_confident_drafts_k(trained, engine_runs, scaled_drafters,
                                                                max_entropy, plain_outputs):
    runs = {name: serve_fitted(trained, engine_runs, f"fitted-edsd-adaptive-{name}",
                               adaptive_spec(drafter, max_entropy))
            for name, drafter in scaled_drafters.items()}
    uncertain, confident = runs["uncertain"], runs["confident"]
    assert uncertain["outputs"] == confident["outputs"] == plain_outputs
    assert uncertain["counters"]["drafts"] == uncertain["counters"]["draft_tokens"] == 0
    assert confident["counters"]["draft_tokens"] == K * confident["counters"]["drafts"] > 0
    # Scaling keeps the argmax: the confident drafter drafts the unscaled drafter's full chains.
    assert_counters_match(predicted_counters(trained, confident["outputs"], K), confident["counters"])


def test_server_with_two_data_parallel_engines(trained, max_entropy, plain_outputs, tmp_path):
    """Data parallelism with EDSD (the static path is the same engines without the cut):
    the JSON config on the server's command line reaches both engine cores (each drafts),
    the ranks stay in step while their requests stop drafting at different steps, and the
    counters of both together are the reference's replay of the cut chains; streams abandoned
    mid-way leave the engines serving the same output."""
    spec = adaptive_spec(trained["edsd-folded"], max_entropy)
    # Each rank's KV cache is the tests' 1 GiB (support/shared.py): at a quarter of the machine's
    # memory each, two ranks beside another test's engine ran a 24-GiB CI machine out of memory.
    dp_args = [*SERVER_ARGS, "--data-parallel-size", "2"]
    with running_server(trained["target"], spec, extra_args=dp_args,
                        log_path=tmp_path / "dp.log", env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"}) as base:
        outputs = completion_token_ids(base, trained["prompts"])
        metrics = requests.get(f"{base}/metrics", timeout=10).text
        # Clients that walk away mid-stream, drafts being cut: the engines serve on, losslessly.
        body = {"model": "toy", "max_tokens": 512, "temperature": 0, "ignore_eos": True}
        read = abandon_streams(f"{base}/v1/completions", [{**body, "prompt": p} for p in trained["prompts"]])
        after_aborts = completion_token_ids(base, trained["prompts"])
    assert min(read) > 0 and after_aborts == plain_outputs
    assert outputs == plain_outputs
    assert drafting_engines(metrics) == {"0", "1"}
    measured = parse_prometheus_counters(metrics).as_dict()
    predicted = predicted_counters(trained, outputs, K, max_entropy)
    assert_counters_match(predicted, measured)
    assert predicted.draft_tokens == pytest.approx(measured["draft_tokens"], rel=0.02)


def test_preempted_requests_keep_their_cut_drafts_lossless(trained, engine_runs, max_entropy, plain_outputs):
    """A KV cache too small for the eight requests at once: the scheduler preempts some, drops
    their pending (cut) drafts and recomputes them later. The output is the target's own and
    the counters are the reference's prediction under the rule, less at most one draft per
    preemption."""
    job = {"target": trained["target"], "speculative_config": adaptive_spec(trained["edsd"], max_entropy),
           "llm_kwargs": {"enforce_eager": True, "dtype": "float32", **SMALL_CACHE},
           "phases": [greedy_phase("crowded", trained["prompts"], FITTED_TOKENS)]}
    crowded = engine_runs("fitted-edsd-adaptive-preempted", job)["phases"]["crowded"]
    preempted, measured = crowded["preemptions"], crowded["counters"]
    assert preempted > 0, "the cache was large enough: nothing was preempted"
    assert crowded["outputs"] == plain_outputs
    predicted = predicted_counters(trained, crowded["outputs"], K, max_entropy)
    assert predicted.drafts - preempted <= measured["drafts"] <= predicted.drafts
    assert abs(predicted.draft_tokens - measured["draft_tokens"]) <= 0.02 * measured["draft_tokens"] + K * preempted
    assert 0 < measured["draft_tokens"] < K * measured["drafts"], "the rule cut nothing, or drafted nothing"
