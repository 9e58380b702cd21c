"""EDSD in float16 (methods/edsd/float16_range.py, methods/edsd/range_probe.py): where the drafter's values
leave float16's range, per draft step, and the reference drafter drafting in float16 what it
drafts in float32, on the demo target with the paper's draft layer trained for it, and on a toy
target with a massive first-token activation."""

from __future__ import annotations

import pytest
import torch
from support.drafters import paper_layer_edsd
from transformers import AutoTokenizer

import vllm_edsd.methods.edsd.float16_range as float16_range
from vllm_edsd.demo.target import demo_target
from vllm_edsd.features.hidden_states import run_target
from vllm_edsd.launch.transformers_target import load_target
from vllm_edsd.methods.edsd.model import EDSDDraftModel
from vllm_edsd.methods.edsd.range_probe import first_beyond_float16, step_peaks, value_ranges

STEPS = 4


def test_scaled_linear_is_exact_in_float32_and_holds_large_rows_in_float16():
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 32, bias=False)
    x = torch.randn(5, 64) * torch.tensor([[1e-3], [1.0], [3e4], [7e5], [2e7]])
    x[1].zero_()  # a padding row
    with torch.no_grad():
        assert torch.equal(float16_range.scaled_linear(linear, x, torch.float32), linear(x))
        half = float16_range.scaled_linear(linear.half(), x, torch.float16)
        want = linear.float()(x)
    assert half.dtype == torch.float32 and torch.isfinite(half).all()
    assert torch.allclose(half, want, rtol=0, atol=2e-3 * want.abs().amax().item())


def test_stored_state_reads_back_within_bfloat16s_precision():
    values = torch.tensor([0.0, 1e-3, -0.5, 3.0, -255.0, 256.0, 7e4, -4e5, 3e6, -1.1e9])
    stored = float16_range.store_state(values, torch.float16)
    read = float16_range.load_state(stored)
    assert stored.dtype == torch.float16 and torch.isfinite(stored).all()
    small = values.abs() < 256
    assert torch.allclose(read[small], values[small], rtol=2**-10, atol=1e-4)
    assert ((read[~small] - values[~small]).abs() <= 2**-8 * values[~small].abs()).all()


def drafts_in(drafter: EDSDDraftModel, features: torch.Tensor, tokens: torch.Tensor, dtype: torch.dtype):
    """The drafter's chains (and value ranges) with drafter and features in ``dtype``."""
    copy = EDSDDraftModel(drafter.config)
    copy.load_state_dict(drafter.state_dict())
    copy = copy.to(dtype).eval()
    return copy.propose(features.to(dtype), tokens, STEPS), value_ranges(copy, features.to(dtype), tokens, STEPS)


def assert_float16_drafts_as_float32(drafter: EDSDDraftModel, features: torch.Tensor, tokens: torch.Tensor,
                                     beyond_from: int = 0) -> None:
    """Where float32 values leave float16's range at every step from ``beyond_from`` on, float16
    drafting keeps every float16 tensor finite and drafts the float32 chains (at least 95 % of
    every position)."""
    chains32, ranges32 = drafts_in(drafter, features, tokens, torch.float32)
    chains16, ranges16 = drafts_in(drafter, features, tokens, torch.float16)
    assert sorted(first_beyond_float16(ranges32)) == list(range(beyond_from, STEPS))
    assert all(r.finite for r in ranges16 if r.dtype == torch.float16)
    assert all(r.peak <= float16_range.FLOAT16_MAX for r in ranges16 if r.dtype == torch.float16)
    assert (chains16 == chains32).float().mean(dim=(0, 1)).min() >= 0.95


@pytest.fixture(scope="module")
def paper_layer_drafter():
    """The demo target in float32, the paper's draft layer trained for it, and one chat answered greedily."""
    path = demo_target()
    target = load_target(path)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    chat = [{"role": "user", "content": "What is a hash table, and when would I use one?"}]
    prompt = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=True,
                                           return_tensors="pt")["input_ids"]
    sequence = target.generate(prompt, max_new_tokens=48, do_sample=False)
    drafter = EDSDDraftModel.from_pretrained(paper_layer_edsd(), embed_tokens=target.model.embed_tokens.weight)
    layers = drafter.config.aux_layer_ids
    return drafter, run_target(target, sequence, layers).features(layers)[:, :-1], sequence[:, 1:]


def test_paper_layer_overflows_float16_in_edfuse_from_the_first_step(paper_layer_drafter):
    """The paper's draft layer's values, in float32: EDFuse's output passes 65,504 at the first draft
    step, its gate reads the overflowing fed-back state from the third, and the largest value
    grows at least threefold per step."""
    drafter, features, tokens = paper_layer_drafter
    ranges = value_ranges(drafter, features, tokens, STEPS)
    first = first_beyond_float16(ranges)
    assert first[0].module == "edfuse.down_proj"
    assert {first[step].module for step in (2, 3)} == {"edfuse.gate_proj"}
    peaks = step_peaks(ranges)
    assert all(later > 3 * earlier for earlier, later in zip(peaks, peaks[1:]))


def test_paper_layer_drafts_in_float16_what_it_drafts_in_float32(paper_layer_drafter):
    assert_float16_drafts_as_float32(*paper_layer_drafter)


# fc's normed input (the reads-token drafter's norm_before_fc) keeps the first steps in float16's
# range; the fed-back state, growing tenfold per step, leaves it at the last; with the residual
# normed it stays in range, EDFuse's residual (fuse_residual) beside it.
@pytest.mark.parametrize(("drafter", "beyond_from"), [("drafter", 0), ("reads-token", STEPS - 1),
                                                      ("normed-residual", STEPS)])
def test_toy_target_with_a_massive_first_token_activation(massive_activation, drafter, beyond_from):
    """A target whose first token carries 30,000 on one dimension, and a drafter whose
    fed-back state grows per step, the paper's draft layer and the one whose attention also
    reads the token and whose fc reads the features normed (in float32, before float16's
    scaling), and that one with both residual switches: float16 drafts as float32 does."""
    target = load_target(massive_activation["target"])
    embed = target.model.embed_tokens.weight
    drafter = EDSDDraftModel.from_pretrained(massive_activation[drafter], embed_tokens=embed)
    sequence = torch.tensor([[1, *range(10, 74)]])
    layers = drafter.config.aux_layer_ids
    features = run_target(target, sequence, layers).features(layers)[:, :-1]
    assert features[0, 0].abs().amax() >= 30000
    assert_float16_drafts_as_float32(drafter, features, sequence[:, 1:], beyond_from)
