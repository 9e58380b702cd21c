"""The CPU noise of sampled speculative decoding (serving/repairs/cpu_noise.py): the recovered tokens
and the sampled drafts follow the distributions vLLM's own code samples from, seeds reproduce,
and the plugin replaces vLLM's two functions on CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from vllm_edsd.serving.repairs.cpu_noise import exponential_noise, recovered_tokens, row_argmax, sampled_drafts

SAMPLES = 20_000
VOCAB = 8


def _frequencies(draw, rows: int) -> torch.Tensor:
    counts = torch.zeros(rows, VOCAB)
    for _ in range(SAMPLES):
        counts[torch.arange(rows), draw().long()] += 1
    return counts / SAMPLES


def _total_variation(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    return (got - want).abs().sum(dim=-1) / 2


def _probabilities(rows: int, seed: int) -> torch.Tensor:
    return torch.softmax(torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2, dim=-1)


def test_recovered_tokens_follow_the_residual_distribution():
    """Two requests of two and one draft positions (unequal, so the noise is copied per row):
    each position's token follows max(p - q, 0) normalised, with one noise row per request."""
    torch.manual_seed(0)
    target, draft = _probabilities(3, 1), _probabilities(3, 2)
    got = _frequencies(lambda: recovered_tokens(target, draft, torch.tensor([1, 2, 3], dtype=torch.int32),
                                                [2, 1], {}), 3)
    residual = (target - draft).clamp(min=0)
    assert (_total_variation(got, residual / residual.sum(dim=-1, keepdim=True)) < 0.02).all()


def test_without_draft_probabilities_the_draft_token_is_never_recovered():
    """Drafts without probabilities (n-gram, the lookup's rows): the target's distribution
    without the draft token, as vLLM's kernel masks it."""
    torch.manual_seed(1)
    target, drafted = _probabilities(2, 3), torch.tensor([0, 5])
    got = _frequencies(lambda: recovered_tokens(target, None, drafted, [2], {}), 2)
    want = target.clone()
    want[torch.arange(2), drafted] = 0
    assert (got[torch.arange(2), drafted] == 0).all()
    assert (_total_variation(got, want / want.sum(dim=-1, keepdim=True)) < 0.02).all()


def test_sampled_drafts_follow_the_tempered_softmax_and_greedy_rows_take_the_argmax():
    torch.manual_seed(2)
    logits = torch.randn(2, VOCAB) * 2
    metadata = SimpleNamespace(temperature=torch.tensor([0.7, 0.0]), all_random=False, all_greedy=False)
    tokens, probs = sampled_drafts(logits.clone(), metadata)
    assert torch.allclose(probs, torch.stack([torch.softmax(logits[0] / 0.7, -1), torch.softmax(logits[1], -1)]))
    got = _frequencies(lambda: sampled_drafts(logits.clone(), metadata)[0], 2)
    assert _total_variation(got[0], torch.softmax(logits[0] / 0.7, -1)) < 0.02
    assert got[1, logits[1].argmax()] == 1.0


def test_a_seeded_request_reproduces_and_one_without_drafts_draws_nothing():
    """Recovered tokens of a request with a generator repeat with its seed; a request that
    drafted nothing leaves its generator untouched, as vLLM's loop does."""
    target, draft = _probabilities(4, 4), _probabilities(4, 5)
    draft_ids = torch.zeros(4, dtype=torch.int32)

    def seeded(seed: int) -> tuple[list[int], torch.Generator]:
        generators = {0: torch.Generator().manual_seed(seed), 1: torch.Generator().manual_seed(99)}
        return recovered_tokens(target, draft, draft_ids, [4, 0], generators).tolist(), generators[1]

    (first, idle), (again, _) = seeded(7), seeded(7)
    assert first == again
    assert torch.equal(idle.get_state(), torch.Generator().manual_seed(99).get_state())


def test_noise_is_positive_exponential_and_row_argmax_takes_the_first_maximum():
    noise = exponential_noise(4, 50_000, torch.device("cpu"))
    assert (noise > 0).all() and abs(noise.mean().item() - 1) < 0.01 and abs(noise.var().item() - 1) < 0.03
    scores = torch.tensor([[0.0, 3.0, 3.0, 1.0], [2.0, 0.0, 0.0, 2.0]])
    assert row_argmax(scores).tolist() == [1, 0]


@pytest.mark.vllm_range
def test_the_plugin_replaces_both_noise_draws_on_cpu():
    """In a fresh process the plugin's load replaces vLLM's two functions, and they run as
    vLLM calls them."""
    code = """
import json, torch, vllm_edsd
vllm_edsd.register()
from types import SimpleNamespace
from vllm.v1.sample import rejection_sampler
from vllm.v1.spec_decode import llm_base_proposer
from vllm_edsd.serving.patching import applied
from vllm_edsd.serving.repairs.cpu_noise import DRAFT_NOISE, RECOVERED_TOKEN_NOISE
meta = SimpleNamespace(generators={}, temperature=torch.tensor([1.0]), all_random=True, all_greedy=False)
probs = torch.softmax(torch.randn(2, 16), -1)
ids = torch.zeros(2, dtype=torch.int32)
recovered = rejection_sampler.sample_recovered_tokens(2, [2], torch.tensor([2]), ids, None, probs, meta, "cpu")
tokens, drafted = llm_base_proposer.compute_probs_and_sample_next_token(torch.randn(1, 16), meta)
print(json.dumps({"applied": [applied(RECOVERED_TOKEN_NOISE), applied(DRAFT_NOISE)],
                  "shapes": [list(recovered.shape), list(tokens.shape), list(drafted.shape)]}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"applied": [True, True], "shapes": [[2], [1], [1, 16]]}
