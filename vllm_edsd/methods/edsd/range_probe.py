"""Where a drafter's values leave float16's range, per draft step.

``value_ranges`` runs a reference drafter's ``propose`` with a hook on every submodule and
records each output's largest magnitude, in the order the outputs are computed; draft step
``k`` begins where the drafter's fusion (EDSD's ``edfuse``, EAGLE-3's ``midlayer``) is entered
for the ``k+1``-th time, and the first step includes ``fc``. Run in float32, it says which
tensor float16 could not hold (``first_beyond_float16``); run in float16, whether any float16
tensor became infinite or NaN. ``float16_range.py`` says why EDSD's do and what serving does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from vllm_edsd.methods.edsd.float16_range import FLOAT16_MAX


@dataclass(frozen=True)
class TensorRange:
    """The largest magnitude of one module output at one draft step (``inf`` when the output
    holds an infinity or a NaN)."""

    step: int
    module: str
    dtype: torch.dtype
    peak: float

    @property
    def finite(self) -> bool:
        return math.isfinite(self.peak)

    @property
    def beyond_float16(self) -> bool:
        return self.peak > FLOAT16_MAX


def _peak(output) -> float:
    tensors = [t for t in (output if isinstance(output, tuple) else (output,)) if isinstance(t, torch.Tensor)]
    peaks = [t.detach().float().abs().nan_to_num(nan=math.inf).amax().item() for t in tensors if t.numel()]
    return max(peaks, default=0.0)


@torch.no_grad()
def value_ranges(drafter: nn.Module, features: torch.Tensor, next_tokens: torch.Tensor, num_steps: int
                 ) -> list[TensorRange]:
    """Every submodule output's peak while ``drafter.propose(features, next_tokens, num_steps)``
    runs, in computation order (``propose``'s arguments as that method takes them)."""
    ranges: list[TensorRange] = []
    steps_begun = [0]
    step = drafter.step

    def counted_step(*args, **kwargs):
        steps_begun[0] += 1
        return step(*args, **kwargs)

    def record(name: str):
        def hook(_module, _args, output) -> None:
            first = output[0] if isinstance(output, tuple) else output
            ranges.append(TensorRange(max(steps_begun[0] - 1, 0), name, first.dtype, _peak(output)))

        return hook

    hooks = [module.register_forward_hook(record(name)) for name, module in drafter.named_modules() if name]
    drafter.step = counted_step  # this instance's draft steps, counted
    try:
        drafter.propose(features, next_tokens, num_steps)
    finally:
        del drafter.step
        for hook in hooks:
            hook.remove()
    return ranges


def first_beyond_float16(ranges: list[TensorRange]) -> dict[int, TensorRange]:
    """Per draft step, the first output that float16 cannot hold (larger than 65,504, infinite
    or NaN); steps whose every output fits are left out."""
    first: dict[int, TensorRange] = {}
    for entry in ranges:
        if (entry.beyond_float16 or not entry.finite) and entry.step not in first:
            first[entry.step] = entry
    return first


def step_peaks(ranges: list[TensorRange]) -> list[float]:
    """The largest magnitude any output reached, per draft step."""
    peaks: dict[int, float] = {}
    for entry in ranges:
        peaks[entry.step] = max(peaks.get(entry.step, 0.0), entry.peak)
    return [peaks[step] for step in sorted(peaks)]
