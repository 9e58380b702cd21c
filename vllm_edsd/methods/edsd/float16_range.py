"""EDSD in float16: its residual stream computed in float32, its fed-back state stored compressed.

Why: EDFuse's gate reads the raw fused feature (``fc`` of the target's features at the first
draft step, the previous step's pre-norm output after it), and nothing normalises it. A target's
first token carries a massive activation (about 24,800 on one dimension in SmolLM2-135M from
layer 12 on), and the fed-back state grows about five times per draft step (the shipped demo
drafter: largest value 68,401 at step 0, 1.8e7 at step 3). Float16 ends at 65,504: the first
token's EDFuse output overflows, its key and value become NaN, and every draft attends to it.
Bfloat16 and float32 have float32's range and need none of this.

What changes in float16 (the weights and every float32 or bfloat16 result stay as they are):

* fc's input norms, where a switch asks for them (``norm_before_fc``, ``fc_norm``), run in
  float32 on the float32 features;
* every linear map whose input is the unnormalised stream (``fc``, EDFuse's gate and down
  projections) runs on its input divided by a per-row power of two, and the result is
  multiplied back in float32: exact in the scaling, so only float16's rounding of the inputs
  remains;
* the residual stream (EDFuse's output plus attention and MLP) and its norms are float32; the
  attention and MLP themselves read normalised inputs and run in float16 as before;
* the state handed from one draft step to the next crosses vLLM's proposer in a buffer of the
  model's dtype, so it is stored as ``asinh(state / 256)`` (at most 84 for any float32 value)
  and read back with ``sinh``: float16's own precision below 256, relative error at most 2**-9
  up to 3.8e5 and 2**-8 (bfloat16's) up to 1.1e9.

``model.py`` (training, tests, parity) and ``vllm_model.py`` both call these.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import torch
import torch.nn.functional as F

from vllm_edsd.methods.blocks import norm_parts

FLOAT16_MAX = torch.finfo(torch.float16).max
# A scaled linear map's input rows peak in [2**7, 2**8): far from float16's top even after a
# weight row sums hundreds of them, and with every element above 2**-16 of the peak still normal.
HEADROOM_EXPONENT = 8
# Where the stored state turns from linear to logarithmic (a power of two: the division is exact).
STATE_SCALE = 256.0


def needs_wide_stream(dtype: torch.dtype) -> bool:
    """Whether EDSD's residual stream must leave ``dtype`` (float16's range is too short)."""
    return dtype == torch.float16


def scaled_linear(linear: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``linear(x)`` in float32 for a float32 ``x`` of any size, computed by ``linear`` in
    ``dtype`` on each row divided by a power of two."""
    peak = x.abs().amax(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    scale = torch.exp2(torch.floor(torch.log2(peak)) + 1 - HEADROOM_EXPONENT)
    return linear((x / scale).to(dtype)).float() * scale


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of a float32 ``x`` in float32 (the weight cast up), returned in float32."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def store_state(state: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The float32 fed-back state as the proposer's ``dtype`` buffer holds it."""
    return torch.asinh(state / STATE_SCALE).to(dtype)


def load_state(stored: torch.Tensor) -> torch.Tensor:
    """The float32 state a ``store_state`` value holds."""
    return torch.sinh(stored.float()) * STATE_SCALE


def project(
    fc: Callable[[torch.Tensor], torch.Tensor],
    features: torch.Tensor,
    dtype: torch.dtype,
    norms: Sequence[tuple[torch.Tensor, float]] = (),
) -> torch.Tensor:
    """``fc`` on the target's features (first draft step), as ``store_state`` holds it. ``norms``
    are fc's input norms, (weight, eps) of RMSNorms each over its equal part of the features
    (``blocks.norm_parts``), applied in float32 before the scaling: squared in float16, the first
    token's massive activation would overflow."""
    features = norm_parts(features.float(), [partial(rms_norm, weight=weight, eps=eps) for weight, eps in norms])
    return store_state(scaled_linear(fc, features, dtype), dtype)


def fuse(
    g: torch.Tensor,
    token: torch.Tensor,
    gate: Callable[[torch.Tensor], torch.Tensor],
    up: Callable[[torch.Tensor], torch.Tensor],
    down: Callable[[torch.Tensor], torch.Tensor],
    dtype: torch.dtype,
) -> torch.Tensor:
    """EDFuse, ``down(silu(gate(g)) * up(token))``, on a float32 ``g``, returned in float32;
    ``token`` is the normed embedding, which fits ``dtype``."""
    return scaled_linear(down, F.silu(scaled_linear(gate, g, dtype)) * up(token).float(), dtype)


def decoder_layer(
    u: torch.Tensor,
    attend: Callable[[torch.Tensor], torch.Tensor],
    mlp: Callable[[torch.Tensor], torch.Tensor],
    input_norm: tuple[torch.Tensor, float],
    post_attention_norm: tuple[torch.Tensor, float],
    dtype: torch.dtype,
    norm_before_residual: bool = False,
) -> torch.Tensor:
    """A pre-norm decoder layer on a float32 residual stream ``u``: attention and MLP run in
    ``dtype`` on the normed stream; the pre-norm output is returned in float32.
    ``input_norm`` and ``post_attention_norm`` are RMSNorms' (weight, eps); with
    ``norm_before_residual`` the residual is the normed stream rather than ``u``."""
    normed = rms_norm(u, *input_norm)
    a = (normed if norm_before_residual else u) + attend(normed.to(dtype)).float()
    return a + mlp(rms_norm(a, *post_attention_norm).to(dtype)).float()
