"""Token rows: the parts of EDSD's draft forward that depend on the input token alone, read
from a table over the draft vocabulary instead of computed.

EDFuse's ``token_up(token_norm(e))`` and, where the draft layer reads the token
(``attention_reads_token``), the token half of its q/k/v (``W_e · token_norm(e)``) are functions
of the draft step's input token and of nothing else. Every token a draft step after the first
reads was drafted, so it lies in the draft vocabulary; and at batch 1 a draft step costs the
bytes of the weights it reads. ``TokenRows`` holds both results for every token of the draft
vocabulary, computed once by the drafter's own layers after it loads, and a forward whose tokens
all lie there reads one row per token where it read two matrices (docs/results.md, "Token rows").
A forward with any token outside the draft vocabulary (the first draft step, after a verified
token the drafter cannot draft) takes the matmuls. The rows equal the matmuls' results up to
float rounding.

Only where the drafter's forward runs as Python on every step, vLLM's CPU runner: the choice reads
the tokens on the host, and a CUDA graph would replay whichever path it captured
(``serving/hooks.py`` attaches the rows on the CPU alone).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from vllm.model_executor.layers.linear import QKVParallelLinear

# The most memory the rows may take on one rank; a larger draft vocabulary or layer keeps the matmuls.
MAX_BYTES = 256 * 2**20
_CHUNK = 1024  # draft-vocabulary rows computed at a time while the table is built


@dataclass(frozen=True)
class QKVRows:
    """The token half of q/k/v for each token of a forward, handed to the attention's input."""

    rows: torch.Tensor


@dataclass(frozen=True)
class FeatureWithTokenRows:
    """The attention's input on the rows path: the feature half, which q/k/v's own matmul reads,
    and the token half's rows, added to its result (``TokenRowsQKV``)."""

    feature: torch.Tensor
    token_rows: torch.Tensor


@dataclass(frozen=True)
class TokenRows:
    """EDFuse's up rows and the q/k/v token rows (None where the layer does not read the token)
    of each draft-vocabulary token, and the slot of each target id in them (-1: outside)."""

    slot_of_target: torch.Tensor
    up: torch.Tensor
    qkv: torch.Tensor | None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.slot_of_target, self.up, self.qkv) if t is not None)

    def rows_of(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, QKVRows] | None:
        """(up rows, q/k/v rows) of a forward's tokens, or None where any lies outside the draft vocabulary."""
        slots = self.slot_of_target[input_ids]
        if bool((slots < 0).any()):
            return None
        return self.up[slots], QKVRows(None if self.qkv is None else self.qkv[slots])


def table_bytes(draft_vocab: int, widths: int, dtype: torch.dtype) -> int:
    """The bytes of a table of ``widths`` values per draft-vocabulary token."""
    return draft_vocab * widths * torch.empty((), dtype=dtype).element_size()


def build(target_ids: torch.Tensor, target_vocab: int, embed, up_of, qkv_of) -> TokenRows:
    """Rows for the draft vocabulary whose target ids are ``target_ids`` (in draft order): ``up_of``
    and ``qkv_of`` (None: no q/k/v rows) map token embeddings (``embed`` of ids) to one rank's rows."""
    ups, qkvs = [], []
    with torch.no_grad():
        for start in range(0, len(target_ids), _CHUNK):
            embeds = embed(target_ids[start:start + _CHUNK])
            ups.append(up_of(embeds))
            if qkv_of is not None:
                qkvs.append(qkv_of(embeds))
        slot_of_target = torch.full((target_vocab,), -1, dtype=torch.long, device=target_ids.device)
        slot_of_target[target_ids] = torch.arange(len(target_ids), device=target_ids.device)
    return TokenRows(slot_of_target, torch.cat(ups), torch.cat(qkvs) if qkvs else None)


def feature_half(qkv_proj, width: int, dtype: torch.dtype, device) -> torch.Tensor:
    """The weight of q/k/v's feature half (the first ``width`` inputs) on this rank, read back
    through the layer itself: on the CPU vLLM packs a linear layer's weight for its kernels and
    may drop the plain tensor. Exact: each output of an identity row is one weight times one."""
    probe = torch.zeros(width, 2 * width, dtype=dtype, device=device)
    probe[:, :width] = torch.eye(width, dtype=dtype, device=device)
    with torch.no_grad():
        columns = qkv_proj(probe)[0]
    return columns.t().contiguous()


class TokenRowsQKV(QKVParallelLinear):
    """vLLM's fused q/k/v projection over ``[input_layernorm(u); token_norm(e)]``; handed
    ``FeatureWithTokenRows`` it computes the feature half alone (``feature_weight``, set with the
    token rows) and adds the token half's rows."""

    feature_weight: torch.Tensor | None = None

    def forward(self, x: torch.Tensor | FeatureWithTokenRows):
        if isinstance(x, FeatureWithTokenRows):
            return F.linear(x.feature, self.feature_weight) + x.token_rows, None
        return super().forward(x)


def _unquantized(linear) -> bool:
    return type(linear.quant_method).__name__ == "UnquantizedLinearMethod"


def of_model(model, draft_to_target: torch.Tensor | None, target_vocab: int) -> TokenRows | None:
    """The token rows of an ``EDSDLlamaModel`` on this rank, over its draft vocabulary
    (``draft_to_target``: d2t's offsets; None where it is the target's), or None where rows
    cannot serve it: a float32 stream beside float16 weights, quantized layers, or rows over
    ``MAX_BYTES``. Where its layer reads the token, q/k/v's feature weight is set too."""
    layer, fuse = model.layers[0], model.edfuse
    qkv_proj = layer.self_attn.qkv_proj if isinstance(layer.self_attn.qkv_proj, TokenRowsQKV) else None
    linears = [fuse.token_up, fuse.feature_gate, fuse.fuse_down] + ([qkv_proj] if qkv_proj is not None else [])
    if model.wide_stream or not all(_unquantized(linear) for linear in linears):
        return None
    device = model.norm.weight.device
    draft_ids = torch.arange(target_vocab if draft_to_target is None else len(draft_to_target), device=device)
    widths = fuse.token_up.output_size_per_partition
    widths += 0 if qkv_proj is None else qkv_proj.output_size_per_partition
    if table_bytes(len(draft_ids), widths, model.dtype) > MAX_BYTES:
        return None
    target_ids = draft_ids if draft_to_target is None else draft_ids + draft_to_target
    rows = build(target_ids, target_vocab, model.embed_input_ids, fuse.token_up_of,
                 None if qkv_proj is None else layer.token_qkv)
    if qkv_proj is not None:
        qkv_proj.feature_weight = feature_half(qkv_proj, qkv_proj.input_size // 2, model.dtype, device)
    return rows
