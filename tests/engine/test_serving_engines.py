"""EDSD speculative decoding in real vLLM engines: lossless greedy output, parity of the
drafts with the plain-PyTorch reference (both token norms, folded and unfolded, TP=1 and
TP=2; the draft-layer switches, fc's input norms among them; EAGLE 3.1's drafters under vLLM's
own eagle3), exact acceptance accounting, sampling,
compilation, a second target architecture."""

from __future__ import annotations

import pytest
import torch
from support.builds import EAGLE31_DRAFTERS
from support.drafters import edited_copy, edsd_spec, speculative_spec
from support.engine_checks import (
    assert_counters_match,
    assert_drafts_match,
    predicted_counters,
    reference_chains,
    simulate_constant_drafter,
)
from support.engine_runs import greedy_phase, llama_edsd_eager, serve_fitted
from support.prompts import PROMPTS

from vllm_edsd.methods.edsd.config import LAYERNORM, RMSNORM
from vllm_edsd.methods.registry import EDSD, VLLM_EAGLE3

K = 4


@pytest.fixture(scope="module")
def eager_run(models, engine_runs) -> dict:
    # float32 like the reference (vLLM on CPU would otherwise pick bfloat16).
    return llama_edsd_eager(models, engine_runs)


@pytest.mark.vllm_range
def test_greedy_output_identical_with_edsd(models, eager_run, baseline):
    """Lossless, and the drafts are the reference model's (loaded from the training checkpoint
    the served drafter was converted from), not just any drafts."""
    phase = eager_run["phases"]["greedy"]
    assert phase["outputs"] == baseline("llama")
    assert phase["counters"]["draft_tokens"] == K * phase["counters"]["drafts"]
    chains_for = reference_chains(models["llama"], models["llama-edsd-training"])
    assert assert_drafts_match(PROMPTS, phase, chains_for, K) >= phase["counters"]["drafts"] > 8 * 8


def test_drafter_with_rope_cache_and_kv_scales_serves_the_same(models, engine_runs, eager_run, tmp_path_factory):
    """RoPE caches and KV-cache scales beside the weights (exporters write them; vLLM's EAGLE-3
    loader takes them): the drafter loads, and with an unquantized KV cache drafts exactly
    what it drafts without them."""
    side = {
        "midlayer.self_attn.rotary_emb.inv_freq": torch.ones(32),
        "midlayer.self_attn.k_proj.k_scale": torch.tensor(1.0),
        "midlayer.self_attn.v_proj.v_scale": torch.tensor(1.0),
    }
    drafter = edited_copy(models["llama-edsd"], tmp_path_factory.mktemp("side-tensors") / "drafter",
                          edit_tensors=lambda t: t.update(side))
    job = {"target": models["llama"], "speculative_config": edsd_spec(str(drafter)),
           "llm_kwargs": {"enforce_eager": True, "dtype": "float32"}, "phases": [greedy_phase(record_proposals=True)]}
    assert engine_runs("llama-edsd-side-tensors", job)["phases"]["greedy"] == eager_run["phases"]["greedy"]


PARITY_PROMPTS, PARITY_TOKENS = PROMPTS[:3], 32
TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}


# Every pair of token norm, folding and tensor parallelism, each engine start a different triple
# (an engine start costs half a minute to a minute on the CI machine): each norm folded and
# not, each at TP=1 and TP=2, and each folding at both.
PARITY_CASES = [(RMSNORM, True, 1), (LAYERNORM, False, 1), (RMSNORM, False, 2), (LAYERNORM, True, 2)]


@pytest.mark.parametrize(("norm", "folded", "tp"), PARITY_CASES,
                         ids=[f"{n}-{'folded' if f else 'unfolded'}-tp{t}" for n, f, t in PARITY_CASES])
def test_drafts_match_reference_model(models, parity_drafters, engine_runs, baseline, norm, folded, tp):
    """Every chain vLLM drafted equals the reference model's chain for that context (first
    and fed-back draft steps), the reference loaded from the checkpoint the served drafter was
    converted from (SpecForge's for RMSNorm, this project's training layout for LayerNorm) and,
    for SpecForge's, also SpecForge's own forward; the output is the target's own. Under TP=2
    every weight is sharded, so a mis-sharded one changes the chains."""
    served, source = parity_drafters[norm, folded]
    check_parity(models, engine_runs, baseline, served, source, f"parity-{norm}-{folded}-tp{tp}", tp,
                 specforge=norm == RMSNORM)


def test_llama3_rope_drafts_match_reference_model(models, parity_drafters, engine_runs, baseline):
    """A drafter with Llama-3.1's RoPE scaling (vLLM's ``Llama3RotaryEmbedding``) drafts what
    the reference's llama3 frequencies draft."""
    served, source = parity_drafters["llama3-rope"]
    check_parity(models, engine_runs, baseline, served, source, "parity-llama3-rope", 1, specforge=False)


# fc's input norms ride on the token-reading drafter's two engine starts: per layer at TP=1, over
# both layers at TP=2.
READS_TOKEN_CASES = [(1, "fc_norm"), (2, "norm_before_fc")]


@pytest.mark.parametrize(("tp", "fc_input_norm"), READS_TOKEN_CASES,
                         ids=[f"{norm}-tp{tp}" for tp, norm in READS_TOKEN_CASES])
def test_token_reading_drafts_match_reference_model(models, parity_drafters, engine_runs, baseline, tp,
                                                    fc_input_norm):
    """The draft layer whose attention also reads the token, with EDFuse's gate reading the
    normed feature (``attention_reads_token``, ``feature_norm``) and fc reading the target's
    features normed (``fc_norm``: one RMSNorm per aux layer; ``norm_before_fc``: one over both,
    there with the layer's residual normed too, ``norm_before_residual``, as EAGLE 3.1 has it, and
    EDFuse's own residual, ``fuse_residual``):
    vLLM's chains are the reference's, also with the wider q/k/v projection sharded over two
    ranks. At TP=2 the drafts come from vLLM's local argmax reduction
    (``use_local_argmax_reduction``), which calls the EDSD model's ``get_top_tokens``: each
    rank's argmax over its shard of the draft vocabulary."""
    served, source = parity_drafters["reads-token", fc_input_norm]
    check_parity(models, engine_runs, baseline, served, source, f"parity-reads-token-{fc_input_norm}-tp{tp}", tp,
                 specforge=False, use_local_argmax_reduction=tp == 2)


@pytest.mark.parametrize("variant", list(EAGLE31_DRAFTERS))
def test_eagle31_drafts_match_reference_model(models, parity_drafters, engine_runs, baseline, variant):
    """EAGLE 3.1's switches (one RMSNorm over fc's input with the normed residual and fed-back
    state; one RMSNorm per target layer) are served by vLLM's own eagle3 class as the reference
    model computes them: its chains are the reference's, loaded from the same directory."""
    served, source = parity_drafters[variant]
    check_parity(models, engine_runs, baseline, served, source, f"parity-{variant}", 1, specforge=False,
                 method=VLLM_EAGLE3)


def check_parity(models, engine_runs, baseline, served: str, source: str, key: str, tp: int, specforge: bool,
                 method: str = EDSD, use_local_argmax_reduction: bool = False) -> None:
    """vLLM serving ``served`` with ``method`` outputs the target's own greedy text and drafts
    exactly the chains ``method``'s reference model, loaded from ``source``, drafts."""
    extra = {"use_local_argmax_reduction": True} if use_local_argmax_reduction else {}
    job = {
        "target": models["llama"],
        "speculative_config": speculative_spec(method, served, **extra),
        "llm_kwargs": {"enforce_eager": True, "dtype": "float32", "tensor_parallel_size": tp},
        "phases": [greedy_phase("parity", PARITY_PROMPTS, max_tokens=PARITY_TOKENS, record_proposals=True)],
    }
    run = engine_runs(key, job, env=TP2_ENV if tp == 2 else None)
    # the drafts are argmaxed in the draft vocabulary, on every rank: by the plugin's hook
    # (serving/draft_vocab.py), or by vLLM's local argmax reduction through the model's get_top_tokens
    expected = "method" if use_local_argmax_reduction else "DraftVocabSampling"
    assert run["draft_samplers"] == [expected] * tp, run["draft_samplers"]
    phase = run["phases"]["parity"]
    assert phase["outputs"] == [out[:PARITY_TOKENS] for out in baseline("llama")[:3]]
    chains_for = reference_chains(models["llama"], source, specforge, method=method)
    assert assert_drafts_match(PARITY_PROMPTS, phase, chains_for, K) >= 3 * 8
    first_tokens = {step[0][0] for recorded in phase["proposals"] for step in recorded}
    assert len(first_tokens) > 5, "the drafts should depend on the drafter's weights, not be constant"


def test_acceptance_counts_are_exact(models, engine_runs, baseline):
    job = {
        "target": models["llama"],
        "speculative_config": edsd_spec(models["llama-edsd-constant"]),
        "llm_kwargs": {"enforce_eager": True, "dtype": "float32"},
        "phases": [greedy_phase()],
    }
    phase = engine_runs("llama-constant", job)["phases"]["greedy"]
    assert phase["outputs"] == baseline("llama")
    drafts, per_pos = simulate_constant_drafter(phase["outputs"], models["constant_token"], K)
    assert sum(per_pos) > 0, "the fixture's target never emits the constant token"
    assert phase["counters"]["drafts"] == drafts
    assert phase["counters"]["accepted_per_pos"] == per_pos
    assert phase["counters"]["accepted"] == sum(per_pos)


def test_compiled_engine(trained, engine_runs):
    """The drafter is compiled like vLLM's EAGLE-3 model (``support_torch_compile``); the
    compiled drafter's acceptance is what the reference predicts, not just any."""
    spec = edsd_spec(trained["edsd"])
    run = serve_fitted(trained, engine_runs, "fitted-edsd-compiled", spec, eager=False)
    assert run["outputs"] == serve_fitted(trained, engine_runs, "pipeline-none", None)["outputs"]
    assert_counters_match(predicted_counters(trained, run["outputs"], K), run["counters"])


SAMPLED = {"temperature": 0.8, "max_tokens": 32, "ignore_eos": True}


def sampling_job(models, draft_sample_method: str) -> dict:
    """Seeded requests at temperature > 0, one request at a time."""
    phase = {"prompts": PROMPTS[:4], "sampling": {**SAMPLED, "seed": 1234}, "one_at_a_time": True}
    return {
        "target": models["llama"],
        "speculative_config": edsd_spec(models["llama-edsd"], draft_sample_method=draft_sample_method),
        "llm_kwargs": {"enforce_eager": True, "dtype": "float32", "seed": 7},
        "phases": [
            {"name": "first", **phase},
            {"name": "again", **phase},
            {"name": "other-seed", **phase, "sampling": {**SAMPLED, "seed": 99}},
        ],
    }


def test_probabilistic_drafting(models, engine_runs):
    """Sampled drafts, with their probabilities kept for the rejection sampler. vLLM 0.32
    draws them from the worker's global generator rather than the request seed (its own
    TODO in ``compute_probs_and_sample_next_token``), so the tokens are not compared."""
    phases = engine_runs("sampling-probabilistic", sampling_job(models, "probabilistic"))["phases"]
    for phase in phases.values():
        assert [len(out) for out in phase["outputs"]] == [32] * 4
        assert phase["counters"]["drafts"] > 0
        assert phase["counters"]["draft_tokens"] == K * phase["counters"]["drafts"]


def test_second_architecture_qwen3(models, engine_runs, baseline):
    job = {
        "target": models["qwen3"],
        "speculative_config": edsd_spec(models["qwen3-edsd"]),
        "llm_kwargs": {"enforce_eager": True, "dtype": "float32"},
        "phases": [greedy_phase(record_proposals=True)],
    }
    phase = engine_runs("qwen3-edsd", job)["phases"]["greedy"]
    assert phase["outputs"] == baseline("qwen3")
    chains_for = reference_chains(models["qwen3"], models["qwen3-edsd"])
    assert assert_drafts_match(PROMPTS, phase, chains_for, K) >= phase["counters"]["drafts"] > 8 * 8
