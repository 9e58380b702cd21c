"""EDSD speculative decoding in real vLLM engines: lossless greedy output, parity of the
drafts with the plain-PyTorch reference, exact acceptance accounting, sampling, TP=2,
compilation, a second target architecture."""

from __future__ import annotations

import pytest
import torch

from conftest import CONSTANT_TOKEN, PROMPTS, greedy_phase
from vllm_edsd.reference import EDSDDraftModel
from vllm_edsd.target import load_target, run_target

K = 4


def edsd(model: str, **extra) -> dict:
    return {"method": "edsd", "model": model, "num_speculative_tokens": K, **extra}


def simulate_constant_drafter(outputs: list[list[int]], token: int, k: int) -> tuple[int, list[int]]:
    """Drafts and accepted-per-position that a drafter always proposing ``token`` must
    produce on these greedy outputs: each step drafts k copies, the target accepts the
    leading ones equal to its own next tokens, then adds one token of its own."""
    drafts, per_pos = 0, [0] * k
    for out in outputs:
        i = 0  # index of the last token the target has produced
        while i < len(out) - 1:
            drafts += 1
            accepted = 0
            while accepted < k and i + 1 + accepted < len(out) and out[i + 1 + accepted] == token:
                per_pos[accepted] += 1
                accepted += 1
            i += accepted + 1
    return drafts, per_pos


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
    """Every chain vLLM drafted equals the reference model's chain for that context."""
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
    drafts, per_pos = simulate_constant_drafter(phase["outputs"], CONSTANT_TOKEN, K)
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
    drafts, per_pos = simulate_constant_drafter(expected, CONSTANT_TOKEN, K)
    assert (phase["counters"]["drafts"], phase["counters"]["accepted_per_pos"]) == (drafts, per_pos)


def test_compiled_engine_with_probabilistic_drafting(models, engine_runs, baseline):
    sampled = {"temperature": 0.8, "max_tokens": 32, "seed": 1234, "ignore_eos": True}
    job = {
        "target": models["llama"],
        "speculative_config": edsd(models["llama-edsd"], draft_sample_method="probabilistic"),
        "llm_kwargs": {"enforce_eager": False, "dtype": "float32"},
        "phases": [
            greedy_phase(),
            {"name": "sample-a", "prompts": PROMPTS, "sampling": sampled},
            {"name": "sample-b", "prompts": PROMPTS, "sampling": sampled},
            {"name": "sample-c", "prompts": PROMPTS, "sampling": {**sampled, "seed": 99}},
        ],
    }
    phases = engine_runs("llama-edsd-compiled", job)["phases"]
    assert phases["greedy"]["outputs"] == baseline("llama")
    assert phases["sample-a"]["outputs"] == phases["sample-b"]["outputs"]
    assert phases["sample-a"]["outputs"] != phases["sample-c"]["outputs"]
    assert phases["sample-a"]["counters"]["drafts"] > 0


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
