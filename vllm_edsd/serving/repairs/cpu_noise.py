"""Sampled speculative decoding on vLLM's CPU build: the exponential noise drawn six times faster.

vLLM samples with the Gumbel-max trick: a token is ``argmax(probs / E)``, with ``E`` Exp(1) noise
per vocabulary entry. Its CPU sampler for the target's tokens draws that noise in a C++ kernel of
its own, but two places of speculative decoding still call torch's ``Tensor.exponential_``,
which on CPU costs about 16 ns an entry against under 3 ns for a uniform draw (2-core Intel
Xeon, torch 2.13, one thread; docs/results.md):

- the rejection sampler's recovered tokens (``rejection_sampler.sample_recovered_tokens``): one
  row of the target's vocabulary per request and decode step, 0.8 ms for the demo target's 49,152;
- each sampled draft step (``llm_base_proposer.compute_probs_and_sample_next_token``).

The replacements draw ``E = -log(U)`` from torch's uniform ``U`` in [0, 1), so that U = 0 gives
E = inf, a weight of 0, never a division by zero, and take the recovered tokens' argmax by numpy
(``row_argmax``: torch's CPU argmax is the slower by far). The rest is vLLM's arithmetic in torch: the
recovered token at each draft position is ``argmax(max(p - q, 0) / E)`` with one ``E`` per
request, and without draft probabilities ``argmax(p / E)`` over every token but the draft's,
as vLLM's kernel computes it; a draft is ``argmax(softmax(logits / T) / E)``, the argmax for a
greedy request. Requests with a seed draw their recovered-token noise from their generator, as
vLLM's does (vLLM draws draft noise unseeded). Float64 noise (``use_fp64_gumbel``) stays vLLM's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from vllm_edsd.launch.engine import on_cpu
from vllm_edsd.serving.patching import Patch


def exponential_noise(rows: int, columns: int, device: torch.device,
                      generators: dict[int, torch.Generator] | None = None) -> torch.Tensor:
    """Exp(1) noise of shape (rows, columns) in float32 as ``-log(U)``; row ``i`` drawn from
    ``generators[i]`` where given, from torch's default generator otherwise."""
    uniform = torch.rand(rows, columns, device=device)
    for row, generator in (generators or {}).items():
        uniform[row].uniform_(generator=generator)
    return uniform.log_().neg_()


def recovered_tokens(target_probs: torch.Tensor, draft_probs: torch.Tensor | None,
                     draft_token_ids: torch.Tensor, num_draft_tokens: list[int],
                     generators: dict[int, torch.Generator]) -> torch.Tensor:
    """The token each draft position resamples from on rejection: ``max(p - q, 0)`` normalised
    (``p`` without the draft token where drafts carry no probabilities), by one row of noise per
    request; a request without drafts draws none, so its generator is left as vLLM leaves it."""
    seeded = {row: generator for row, generator in generators.items() if num_draft_tokens[row] > 0}
    noise = exponential_noise(len(num_draft_tokens), target_probs.shape[-1], target_probs.device, seeded)
    if draft_probs is None:
        residual = target_probs.clone()
        residual.scatter_(1, draft_token_ids.long().unsqueeze(1), 0.0)
    else:
        residual = (target_probs - draft_probs).clamp_(min=0.0)
    _divide_by_request(residual, noise, num_draft_tokens)
    return row_argmax(residual).to(draft_token_ids.dtype)


def _divide_by_request(rows: torch.Tensor, noise: torch.Tensor, num_draft_tokens: list[int]) -> None:
    """Divide each draft position's row by its request's row of noise, in place: by broadcasting
    where every request drafted alike (the common case), else through a copy of the noise per row."""
    requests, drafted = len(num_draft_tokens), num_draft_tokens[0] if num_draft_tokens else 0
    if drafted > 0 and num_draft_tokens.count(drafted) == requests:
        rows.view(requests, drafted, rows.shape[-1]).div_(noise.unsqueeze(1))
        return
    counts = torch.tensor(num_draft_tokens, device=rows.device)
    rows.div_(noise.repeat_interleave(counts, dim=0, output_size=rows.shape[0]))


def row_argmax(scores: torch.Tensor) -> torch.Tensor:
    """Each row's first largest entry of a CPU tensor, by numpy: torch's CPU ``argmax`` takes
    about 63 us for a row of 49,152 float32 entries, numpy's about 2.5 (2-core Xeon, torch 2.13)."""
    return torch.from_numpy(scores.numpy().argmax(axis=-1))


def _recovered_with_fast_noise(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def sample_recovered_tokens(max_spec_len: int, num_draft_tokens: list[int], cu_num_draft_tokens: torch.Tensor,
                                draft_token_ids: torch.Tensor, draft_probs: torch.Tensor | None,
                                target_probs: torch.Tensor, sampling_metadata: Any, device: torch.device,
                                use_fp64_gumbel: bool = False) -> torch.Tensor:
        if use_fp64_gumbel:
            return original(max_spec_len, num_draft_tokens, cu_num_draft_tokens, draft_token_ids, draft_probs,
                            target_probs, sampling_metadata, device, use_fp64_gumbel)
        return recovered_tokens(target_probs, draft_probs, draft_token_ids, num_draft_tokens,
                                sampling_metadata.generators)

    return sample_recovered_tokens


def sampled_drafts(logits: torch.Tensor, sampling_metadata: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """One draft token per row and the probabilities it was drawn from: ``softmax(logits / T)``
    with Gumbel-max noise, the argmax for a greedy request (a temperature below vLLM's
    ``_SAMPLING_EPS``); ``logits`` is divided in place, as vLLM divides it."""
    from vllm.v1.sample.sampler import _SAMPLING_EPS

    temperature = sampling_metadata.temperature
    greedy = None if sampling_metadata.all_random else temperature < _SAMPLING_EPS
    if greedy is not None:
        temperature = torch.where(greedy, 1.0, temperature)
    probs = logits.div_(temperature.view(-1, 1)).softmax(dim=-1, dtype=torch.float32)
    tokens = row_argmax(probs / exponential_noise(*probs.shape, probs.device))
    if greedy is not None:
        tokens = torch.where(greedy, probs.argmax(dim=-1), tokens)
    return tokens, probs


def _drafts_with_fast_noise(original: Callable[..., tuple]) -> Callable[..., tuple]:
    def compute_probs_and_sample_next_token(logits: torch.Tensor, sampling_metadata: Any,
                                            use_fp64_gumbel: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        if sampling_metadata.all_greedy or use_fp64_gumbel:
            return original(logits, sampling_metadata, use_fp64_gumbel)
        return sampled_drafts(logits, sampling_metadata)

    return compute_probs_and_sample_next_token


_WHEN = "on vLLM's CPU platform"
_SLOW = "on CPU torch's exponential_ is several times dearer than a uniform draw (docs/results.md)"

RECOVERED_TOKEN_NOISE = Patch(
    owner="vllm.v1.sample.rejection_sampler",
    attribute="sample_recovered_tokens",
    why=f"draw the recovered tokens' noise as -log(U): {_SLOW}, and a row of the target's vocabulary per "
        "request and step; the same argmax(max(p - q, 0) / E), in torch",
    replace=_recovered_with_fast_noise,
    when=_WHEN,
    only_if=on_cpu,
)

DRAFT_NOISE = Patch(
    owner="vllm.v1.spec_decode.llm_base_proposer",
    attribute="compute_probs_and_sample_next_token",
    why=f"draw each sampled draft step's noise as -log(U): {_SLOW}; the same softmax(logits / T) and "
        "Gumbel-max argmax",
    replace=_drafts_with_fast_noise,
    when=_WHEN,
    only_if=on_cpu,
)
