"""The GPU tier: what only a CUDA machine can show (``bash scripts/test_gpu.sh`` there; skipped
elsewhere). On CUDA vLLM runs Model Runner V2 by default, with CUDA graphs, Triton kernels and
no CPU expansion repair; each test runs under V2 and under V1 (``VLLM_USE_V2_MODEL_RUNNER=0``).
See docs/architecture.md ("Test tiers")."""

from __future__ import annotations

import pytest
from support.drafters import edsd_spec
from support.engine_checks import (
    assert_counters_match,
    assert_drafts_match,
    draft_agreement,
    predicted_counters,
    reference_chains,
)
from support.engine_runs import greedy_phase
from support.prompts import PROMPTS

pytestmark = pytest.mark.gpu

K = 4
RUNNERS = {"v2": {"VLLM_USE_V2_MODEL_RUNNER": "1"}, "v1": {"VLLM_USE_V2_MODEL_RUNNER": "0"}}
SAMPLED_STEPS = 400


def job(target: str, spec: dict | None, phases: list[dict], eager: bool, dtype: str = "float32") -> dict:
    return {"target": target, "speculative_config": spec,
            "llm_kwargs": {"enforce_eager": eager, "dtype": dtype, "gpu_memory_utilization": 0.3},
            "phases": phases}


@pytest.mark.parametrize("runner", RUNNERS)
def test_float16_with_cuda_graphs_beside_a_massive_first_token_activation(massive_activation, engine_runs, runner):
    """EDSD's float32 stream in float16 (methods/edsd/float16_range.py) under CUDA graphs: the drafts
    are the float32 reference's, where float32 values pass 65,504 at every draft step."""
    phases = [greedy_phase(prompts=PROMPTS, max_tokens=24, record_proposals=True)]
    spec = edsd_spec(massive_activation["drafter"], K)
    run = engine_runs(f"gpu-massive-activation-float16-{runner}",
                      job(massive_activation["target"], spec, phases, eager=False, dtype="float16"),
                      env=RUNNERS[runner])
    chains_for = reference_chains(massive_activation["target"], massive_activation["drafter"], k=K)
    same, total = draft_agreement(PROMPTS, run["phases"]["greedy"], chains_for)
    assert total >= 8 * 10 * K and same / total >= 0.9, f"{same} of {total} draft tokens are the reference's"


@pytest.mark.parametrize("runner", RUNNERS)
def test_cuda_graphs_serve_losslessly_at_the_predicted_acceptance(trained, engine_runs, runner):
    """The trained drafter with CUDA graphs (not eager): the target's own greedy output, and
    vLLM's counters are what the reference model predicts."""
    phases = [greedy_phase(prompts=trained["prompts"], max_tokens=40)]
    plain = engine_runs("gpu-fitted-none", job(trained["target"], None, phases, eager=True))
    run = engine_runs(f"gpu-fitted-edsd-graphs-{runner}", job(trained["target"], edsd_spec(trained["edsd"]), phases,
                                                              eager=False), env=RUNNERS[runner])
    outputs = run["phases"]["greedy"]["outputs"]
    assert outputs == plain["phases"]["greedy"]["outputs"]
    assert_counters_match(predicted_counters(trained, outputs, K), run["phases"]["greedy"]["counters"])


@pytest.mark.parametrize("runner", RUNNERS)
def test_drafts_match_reference_model(models, engine_runs, runner):
    """Every chain the GPU drafter proposes (first and fed-back steps) is the reference model's."""
    phases = [greedy_phase(record_proposals=True)]
    run = engine_runs(f"gpu-llama-edsd-{runner}", job(models["llama"], edsd_spec(models["llama-edsd"]), phases,
                                                      eager=True), env=RUNNERS[runner])
    phase = run["phases"]["greedy"]
    chains_for = reference_chains(models["llama"], models["llama-edsd-training"])
    assert assert_drafts_match(PROMPTS, phase, chains_for, K) >= phase["counters"]["drafts"] > 8 * 8


@pytest.mark.parametrize("runner", RUNNERS)
def test_target_drafting_for_itself_accepts_its_sampled_drafts(trained, engine_runs, runner):
    """At T=1 a drafter identical to the target must be accepted (>= 0.95): CUDA's own
    rejection sampler, with the plugin installed and its CPU repair not applied."""
    spec = {"method": "draft_model", "model": trained["target"], "num_speculative_tokens": K,
            "draft_sample_method": "probabilistic"}
    phases = [{"name": "sampled", "prompts": trained["prompts"],
               "sampling": {"temperature": 1.0, "max_tokens": SAMPLED_STEPS // len(trained["prompts"]),
                            "ignore_eos": True}}]
    counters = engine_runs(f"gpu-t1-self-{runner}", job(trained["target"], spec, phases, eager=False),
                           env=RUNNERS[runner])["phases"]["sampled"]["counters"]
    assert counters["drafts"] > 50
    assert counters["accepted"] >= 0.95 * counters["draft_tokens"], counters
