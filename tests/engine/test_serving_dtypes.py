"""EDSD and EAGLE-3 served in every dtype a user can pick (float16, bfloat16, float32): the demo
pair's per-position acceptance at K=7 within 0.05 of float32's (EAGLE-3 in the 16-bit dtypes this
CPU computes natively), and, on a toy target
whose first token carries a massive activation, drafts in every dtype that are the float32 reference's.

EDSD's residual stream leaves float16's range from the first draft step (methods/edsd/float16_range.py);
before the float32 stream its float16 drafts collapsed (the bench's held-out prompts, K=4: first
position 0.019 against float32's 0.381)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support.drafters import edsd_spec, paper_layer_edsd
from support.engine_checks import draft_agreement, reference_chains
from support.engine_runs import greedy_phase
from support.prompts import PROMPTS
from support.specforge_layout import write_specforge_checkpoint
from transformers import AutoTokenizer

from vllm_edsd.demo.target import demo_target
from vllm_edsd.launch.engine import cpu_computes_natively, cpu_dtype
from vllm_edsd.methods.edsd.layouts import SPECFORGE_EDSD
from vllm_edsd.methods.edsd.model import EDSDDraftModel
from weights_convert import convert

K = 7
MASSIVE_K = 4
TOLERANCE = 0.05
# 6 prompts of 32 tokens: about 110 drafts at K=7, a draft 0.01 of a position's rate. Emulated, a
# float16 engine generates about 3 tokens/s (2-core AMD EPYC, AVX2 only), where 48 tokens cost 175 s
# of CI; there its drafts were float32's, each one.
MAX_TOKENS = 32
DEMO = {"edsd": "vllm_edsd/assets/demo/edsd", "eagle3": "vllm_edsd/assets/demo/eagle3"}
CHATS = [
    "Explain what a linked list is and when to use one.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "What are three tips for a good night's sleep?",
    "Summarise the plot of Romeo and Juliet in a few sentences.",
    "Write a SQL query that counts the orders per customer.",
    "Why is the sky blue?",
]
# bfloat16 where this CPU computes it natively: emulated, it is slow and vLLM's docs advise against it.
DTYPES = ["float16", "float32"] + (["bfloat16"] if cpu_dtype() == "bfloat16" else [])


@pytest.fixture(scope="module")
def demo_prompts() -> tuple[str, list[list[int]]]:
    target = str(demo_target())
    tokenizer = AutoTokenizer.from_pretrained(target)
    chats = [[{"role": "user", "content": chat}] for chat in CHATS]
    return target, [tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=True)["input_ids"]
                    for chat in chats]


@pytest.fixture(scope="module")
def specforge_converted(demo_prompts, tmp_path_factory) -> str:
    """The paper's draft layer trained for the demo target, its weights as SpecForge saves an
    ``EdsdDraftModel`` (its names, its config, layer ids counted as layer outputs), converted by
    ``edsd convert``: the same tensors, each in its own dtype, through the paper's layout."""
    target, _ = demo_prompts
    root = tmp_path_factory.mktemp("specforge-demo")
    shape = json.loads((Path(target) / "config.json").read_text())
    embed = torch.zeros(shape["vocab_size"], shape["hidden_size"])  # shared with the target: not saved
    drafter = EDSDDraftModel.from_pretrained(paper_layer_edsd(), embed_tokens=embed)
    weights = SPECFORGE_EDSD.rename_from_canonical(drafter.trainable_state_dict())
    layer_ids = [i - 1 for i in drafter.config.aux_layer_ids]
    write_specforge_checkpoint(target, root / "epoch_2_step_900", target_layer_ids=layer_ids,
                               draft_vocab_size=drafter.config.draft_vocab_size, weights=weights)
    convert(root / "epoch_2_step_900", root / "served", target=target)
    served = load_file(root / "served" / "model.safetensors")
    trained = load_file(paper_layer_edsd() / "model.safetensors")
    assert served.keys() == trained.keys()
    assert all(torch.equal(served[name].to(trained[name].dtype), trained[name]) for name in served)
    return str(root / "served")


def per_position(demo_prompts, engine_runs, method: str, dtype: str, drafter: str | None = None) -> list[float]:
    """The demo pair's per-position acceptance at K=7 in ``dtype`` (another drafter of ``method``
    where given). Its first four positions are the drafts a K=4 engine proposes (each draft step
    reads only the steps before it), so K=4 is not served apart: float16 is emulated on most
    CPUs, and its engines are the engine tier's slowest."""
    target, prompts = demo_prompts
    job = {"target": target, "speculative_config": {**edsd_spec(drafter or DEMO[method], K), "method": method},
           "llm_kwargs": {"enforce_eager": True, "dtype": dtype, "max_model_len": 1024},
           "phases": [greedy_phase(prompts=prompts, max_tokens=MAX_TOKENS)]}
    phases = engine_runs(f"demo-{method}-{dtype}-{Path(drafter or DEMO[method]).name}", job)["phases"]
    return phases["greedy"]["counters"]["acceptance_per_pos"]


def assert_accepts_as(measured: list[float], reference: list[float], what: str) -> None:
    assert reference[0] > 0.2, f"the drafter drafts too little to compare: {reference}"
    assert len(measured) == K
    gaps = [abs(a - b) for a, b in zip(measured, reference, strict=True)]
    assert max(gaps) <= TOLERANCE, f"K={K}: {what} {measured} against float32 {reference}"


# EAGLE-3 in a 16-bit dtype this CPU emulates is left out: vLLM's own eagle3 model serves it, its
# fed-back state stays within float16's range (EDSD's leaves it), and its float16 engine took 216 s
# of CI on a 2-core AVX2-only EPYC; the GPU tier serves both in float16.
DEMO_CASES = [("edsd", d) for d in DTYPES if d != "float32"] + \
    [("eagle3", d) for d in DTYPES if d != "float32" and cpu_computes_natively(d)]


@pytest.mark.parametrize(("method", "dtype"), DEMO_CASES)
def test_demo_pair_accepts_as_in_float32(demo_prompts, engine_runs, method, dtype):
    reference = per_position(demo_prompts, engine_runs, method, "float32")
    assert_accepts_as(per_position(demo_prompts, engine_runs, method, dtype), reference, dtype)


def test_paper_layer_in_float16_from_a_specforge_checkpoint_accepts_as_in_float32(demo_prompts, engine_runs,
                                                                                   specforge_converted):
    """The paper's draft layer and layout as SpecForge trains them: real weights whose fed-back
    state leaves float16's range, saved as a SpecForge checkpoint and converted, served in
    float16, against the same drafter in float32."""
    reference = per_position(demo_prompts, engine_runs, "edsd", "float32", str(paper_layer_edsd()))
    measured = per_position(demo_prompts, engine_runs, "edsd", "float16", specforge_converted)
    assert_accepts_as(measured, reference, "the paper's layer from a SpecForge checkpoint, in float16")


# The paper's draft layer in every dtype; in float16 also the one whose attention reads the token
# and whose fc reads the features normed (norm_before_fc), with and without both residual switches.
# In bfloat16 on an Intel Xeon with AMX this toy's engine died by SIGILL after its warm-up, where
# the demo pair passed (docs/known-issues.md, "a toy model in bfloat16 died by SIGILL"): only that
# death is expected, with the Python frames the engine died in as its reason.
AMX_SIGILL = "vLLM's bfloat16 kernels on an AMX CPU died by SIGILL on this toy's shapes: "
MASSIVE_CASES = [(dtype, "drafter") for dtype in DTYPES] + [("float16", "reads-token"), ("float16", "normed-residual")]


@pytest.mark.vllm_range
@pytest.mark.parametrize(("dtype", "drafter"), MASSIVE_CASES, ids=[f"{d}-{k}" for d, k in MASSIVE_CASES])
def test_drafts_beside_a_massive_first_token_activation(massive_activation, engine_runs, dtype, drafter):
    """Float32 values pass 65,504 at every draft step here; served in each dtype, the drafts are
    the float32 reference's on the text the engine wrote (a random drafter accepts nothing, so
    its drafts, not its acceptance, are compared)."""
    job = {"target": massive_activation["target"],
           "speculative_config": edsd_spec(massive_activation[drafter], MASSIVE_K),
           "llm_kwargs": {"enforce_eager": True, "dtype": dtype},
           "phases": [greedy_phase(prompts=PROMPTS, max_tokens=24, record_proposals=True)]}
    try:
        phase = engine_runs(f"massive-activation-{dtype}-{drafter}", job)["phases"]["greedy"]
    except pytest.fail.Exception as failure:
        if dtype == "bfloat16" and torch.cpu._is_amx_tile_supported() and "(exit -4)" in str(failure):
            pytest.xfail(AMX_SIGILL + str(failure)[str(failure).find("Fatal Python error"):][:1500])
        raise
    chains_for = reference_chains(massive_activation["target"], massive_activation[drafter], k=MASSIVE_K)
    same, total = draft_agreement(PROMPTS, phase, chains_for)
    assert total >= 8 * 10 * MASSIVE_K
    assert same / total >= 0.9, f"{same} of {total} {dtype} draft tokens are the float32 reference's"
