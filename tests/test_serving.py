"""EDSD speculative decoding in real vLLM engines: lossless greedy output, parity of the
drafts with the plain-PyTorch reference, exact acceptance accounting, sampling, TP=2,
compilation, a second target architecture."""

from __future__ import annotations

import pytest
import torch

from conftest import PROMPTS, greedy_phase, simulate_constant_drafter
from vllm_edsd.reference import EDSDDraftModel
from vllm_edsd.target import load_target, run_target

K = 4


def edsd(model: str, **extra) -> dict:
    return {"method": "edsd", "model": model, "num_speculative_tokens": K, **extra}


@pytest.fixture(scope="module")
def eager_run(models, engine_runs) -> dict:
    job = {
        "target": models["llama"],
        "speculative_config": edsd(models["llama-edsd"]),
        # float32 like the reference (vLLM on CPU would otherwise pick bfloat16).
        "llm_kwargs": {"enforce_eager": True, "dtype": "float32"},
        "phases": [greedy_phase(), greedy_phase("parity", PROMPTS[:3], max_tokens=40, record_proposals=True)],
    }
    return engine_runs("llama-edsd-eager", job)


def test_greedy_output_identical_with_edsd(eager_run, baseline):
    run = eager_run
    assert run["phases"]["greedy"]["outputs"] == baseline("llama")
    counters = run["phases"]["greedy"]["counters"]
    assert counters["drafts"] > 0 and counters["draft_tokens"] == K * counters["drafts"]


def test_drafts_match_reference_model(models, eager_run):
    """Every chain vLLM drafted (from a drafter converted by `edsd convert`) equals the
    reference model's chain for that context: first and fed-back draft steps."""
    run = eager_run
    target = load_target(models["llama"])
    drafter = EDSDDraftModel.from_pretrained(models["llama-edsd"], embed_tokens=target.model.embed_tokens.weight)
    phase = run["phases"]["parity"]
    compared = 0
    for prompt, output, recorded in zip(PROMPTS[:3], phase["outputs"], phase["proposals"]):
        sequence = torch.tensor([prompt + output])
        features = run_target(target, sequence, drafter.config.aux_layer_ids).features(drafter.config.aux_layer_ids)
        chains = drafter.propose(features[:, :-1], sequence[:, 1:], K)[0]
        context = len(prompt) + 1  # prompt plus the token sampled at prefill
        for step in recorded:
            assert len(step) == 1, "one request at a time"
            draft = step[0]
            assert draft == chains[context - 2].tolist(), f"step at context length {context}"
            compared += 1
            accepted = 0
            while accepted < K and context + accepted < len(prompt) + len(output) and draft[accepted] == output[context - len(prompt) + accepted]:
                accepted += 1
            context += accepted + 1
    assert compared >= 3 * 8


def test_acceptance_counts_are_exact(models, engine_runs, baseline):
    job = {
        "target": models["llama"],
        "speculative_config": edsd(models["llama-edsd-constant"]),
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


def test_tensor_parallel_2(models, engine_runs, baseline):
    job = {
        "target": models["llama"],
        "speculative_config": edsd(models["llama-edsd-constant"]),
        "llm_kwargs": {"enforce_eager": True, "dtype": "float32", "tensor_parallel_size": 2},
        "phases": [greedy_phase(max_tokens=32)],
    }
    phase = engine_runs("llama-constant-tp2", job, env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})["phases"]["greedy"]
    expected = [out[:32] for out in baseline("llama")]
    assert phase["outputs"] == expected
    drafts, per_pos = simulate_constant_drafter(expected, models["constant_token"], K)
    assert (phase["counters"]["drafts"], phase["counters"]["accepted_per_pos"]) == (drafts, per_pos)


def test_compiled_engine(models, engine_runs, baseline):
    """The drafter is compiled like vLLM's EAGLE-3 model (``support_torch_compile``)."""
    job = {
        "target": models["llama"],
        "speculative_config": edsd(models["llama-edsd"]),
        "llm_kwargs": {"enforce_eager": False, "dtype": "float32"},
        "phases": [greedy_phase()],
    }
    phase = engine_runs("llama-edsd-compiled", job)["phases"]["greedy"]
    assert phase["outputs"] == baseline("llama")
    assert phase["counters"]["drafts"] > 0


SAMPLED = {"temperature": 0.8, "max_tokens": 32, "ignore_eos": True}


def sampling_job(models, draft_sample_method: str) -> dict:
    """Seeded requests at temperature > 0, one request at a time."""
    phase = {"prompts": PROMPTS[:4], "sampling": {**SAMPLED, "seed": 1234}, "one_at_a_time": True}
    return {
        "target": models["llama"],
        "speculative_config": edsd(models["llama-edsd"], draft_sample_method=draft_sample_method),
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
        "speculative_config": edsd(models["qwen3-edsd"]),
        "llm_kwargs": {"enforce_eager": True, "dtype": "float32"},
        "phases": [greedy_phase()],
    }
    phase = engine_runs("qwen3-edsd", job)["phases"]["greedy"]
    assert phase["outputs"] == baseline("qwen3")
    assert phase["counters"]["drafts"] > 0
