"""The EDSD draft model in plain PyTorch: the one definition of the architecture
(docs/architecture.md, "The EDSD draft model").

Training, the converter's validation, the offline acceptance predictor and the parity tests
all use this module; ``vllm_model.py`` mirrors it with vLLM's parallel layers. It imports
nothing from vLLM.

Position ``p`` receives the target feature ``f_p`` (the hidden states at the input of two
target layers, concatenated) and the token ``x_{p+1}``; EDFuse fuses them, one Llama decoder
layer and the shared head (``blocks.DraftHead``) follow. Later draft steps feed back the
decoder layer's pre-norm output instead of ``fc(f_p)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import vllm_edsd.methods.edsd.float16_range as float16_range
from vllm_edsd.checkpoint.files import cast_floating, tensor_shapes, write_checkpoint
from vllm_edsd.checkpoint.layouts import Layout
from vllm_edsd.errors import EDSDError
from vllm_edsd.methods.blocks import (
    DTYPES,
    DraftAttention,
    DraftHead,
    KeyValueSteps,
    RMSNorm,
    SwiGLU,
    check_tensor_shapes,
)
from vllm_edsd.methods.edsd.config import LAYERNORM, EDSDConfig
from vllm_edsd.methods.edsd.layouts import EDSD_TRAINING, read_edsd_config


class DraftDecoderLayer(nn.Module):
    """One Llama decoder layer over the EDFuse output ``u`` (residual ``u``). Its attention reads
    ``input_layernorm(u)`` (width d: the paper's design), or, with ``attention_reads_token``,
    ``[input_layernorm(u); token_norm(e)]`` (width 2d, as EAGLE-3's reads [token; feature]):
    the token itself then lies in every key and value, which copying from the context needs.
    With ``norm_before_residual`` the residual is ``input_layernorm(u)`` (EAGLE 3.1's switch)."""

    def __init__(self, cfg: EDSDConfig) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.input_layernorm = RMSNorm(d, cfg.rms_norm_eps)
        self.token_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.attention_reads_token else None
        self.self_attn = DraftAttention(cfg, input_size=2 * d if cfg.attention_reads_token else d)
        self.post_attention_layernorm = RMSNorm(d, cfg.rms_norm_eps)
        self.mlp = SwiGLU(d, cfg.intermediate_size)
        self.norm_before_residual = cfg.norm_before_residual

    def attention_input(self, normed: torch.Tensor, token_embeds: torch.Tensor) -> torch.Tensor:
        """What q/k/v read, from the normed stream and the token's embedding."""
        if self.token_norm is None:
            return normed
        return torch.cat([normed, self.token_norm(token_embeds)], -1)

    def forward(
        self, u: torch.Tensor, token_embeds: torch.Tensor, positions: torch.Tensor, kv: KeyValueSteps
    ) -> torch.Tensor:
        dtype = self.input_layernorm.weight.dtype
        if u.dtype != dtype:  # a float32 stream around a float16 layer (float16_range.py)
            return float16_range.decoder_layer(
                u, lambda x: self.self_attn(self.attention_input(x, token_embeds), positions, kv), self.mlp,
                (self.input_layernorm.weight, self.input_layernorm.eps),
                (self.post_attention_layernorm.weight, self.post_attention_layernorm.eps), dtype,
                self.norm_before_residual,
            )
        normed = self.input_layernorm(u)
        residual = normed if self.norm_before_residual else u
        a = residual + self.self_attn(self.attention_input(normed, token_embeds), positions, kv)
        return a + self.mlp(self.post_attention_layernorm(a))


def token_norm(cfg: EDSDConfig) -> nn.Module:
    """EDFuse's norm of the token embedding: SpecForge's RMSNorm or the paper's LayerNorm."""
    if cfg.token_norm == LAYERNORM:
        return nn.LayerNorm(cfg.hidden_size, eps=cfg.token_norm_eps)
    return RMSNorm(cfg.hidden_size, cfg.token_norm_eps)


class EDFuse(nn.Module):
    """``down(silu(gate(g)) * up(norm(e)))``: gated fusion of feature and token streams.
    A folded drafter's embedding table already holds ``norm(e)``. With ``feature_norm`` the
    gate reads ``RMSNorm(g)``: the fed-back state then stays bounded from step to step. With
    ``fuse_residual`` that ``g`` is added to the output: the state passes the gate unchanged."""

    def __init__(self, cfg: EDSDConfig) -> None:
        super().__init__()
        d, m = cfg.hidden_size, cfg.fuse_intermediate_size
        self.gate_proj = nn.Linear(d, m, bias=False)
        self.up_proj = nn.Linear(d, m, bias=False)
        self.down_proj = nn.Linear(m, d, bias=False)
        self.token_norm = None if cfg.token_norm_folded else token_norm(cfg)
        self.feature_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.feature_norm else None
        self.fuse_residual = cfg.fuse_residual

    def forward(self, g: torch.Tensor, token_embeds: torch.Tensor) -> torch.Tensor:
        e = token_embeds if self.token_norm is None else self.token_norm(token_embeds)
        if self.feature_norm is not None:
            g = self.feature_norm(g)
        dtype = self.gate_proj.weight.dtype
        if g.dtype != dtype:  # a float32 feature beside float16 weights (float16_range.py)
            fused = float16_range.fuse(g, e, self.gate_proj, self.up_proj, self.down_proj, dtype)
        else:
            fused = self.down_proj(F.silu(self.gate_proj(g)) * self.up_proj(e))
        return g + fused if self.fuse_residual else fused


def expected_shapes(cfg: EDSDConfig) -> dict[str, tuple[int, ...]]:
    """Full (unsharded) shape of every tensor a drafter with this config may carry,
    under training-layout names; derived from the model itself on the meta device."""
    with torch.device("meta"):
        model = EDSDDraftModel(cfg)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def check_tensors(cfg: EDSDConfig, shapes: Mapping[str, tuple[int, ...]], layout: Layout, *, source: str) -> None:
    """Refuse an EDSD checkpoint whose tensor names or shapes do not fit ``cfg`` (``check_tensor_shapes``)."""
    check_tensor_shapes(cfg, shapes, layout, expected_shapes(cfg), source=source)


class EDSDDraftModel(DraftHead):
    """The EDSD drafter. Parameter names are those of the training layout (docs/formats.md, "Training layout")."""

    def __init__(self, cfg: EDSDConfig) -> None:
        super().__init__(cfg, cfg.aux_layer_ids, norm_before_fc=cfg.norm_before_fc, fc_norm=cfg.fc_norm)
        self.edfuse = EDFuse(cfg)
        self.midlayer = DraftDecoderLayer(cfg)

    @classmethod
    def build(cls, cfg: EDSDConfig, aux_layer_ids: tuple[int, ...], **switches: bool) -> EDSDDraftModel:
        """A new EDSD drafter with ``switches`` on; its two aux layers are ``cfg``'s."""
        if tuple(aux_layer_ids) != tuple(cfg.aux_layer_ids):
            raise EDSDError(f"EDSD reads the aux layers of its config {list(cfg.aux_layer_ids)}, "
                            f"not {list(aux_layer_ids)}")
        return cls(cfg.with_updates(**switches))

    @property
    def wide_stream(self) -> bool:
        """Whether the residual stream runs in float32 beside the weights (float16_range.py)."""
        return float16_range.needs_wide_stream(self.fc.weight.dtype)

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """``fc`` on the concatenated target features, normed first where a switch asks
        (``fc_input_norms``), as ``step`` reads its fed-back state."""
        if not self.wide_stream:
            return super().project(features)
        norms = [(norm.weight, norm.eps) for norm in self.fc_input_norms()]
        return float16_range.project(self.fc, features, self.fc.weight.dtype, norms)

    def step(
        self, g: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor, kv: KeyValueSteps
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step: returns (draft-vocab logits, pre-norm output fed back next step)."""
        e = self.embed_tokens(input_ids)
        if not self.wide_stream:
            a = self.midlayer(self.edfuse(g, e), e, positions, kv)
            return self.lm_head(self.norm(a)), a
        dtype = self.fc.weight.dtype
        u = self.edfuse(float16_range.load_state(g), e)
        a = self.midlayer(u, e, positions, kv)
        logits = self.lm_head(float16_range.rms_norm(a, self.norm.weight, self.norm.eps).to(dtype))
        return logits, float16_range.store_state(a, dtype)

    # ------------------------------------------------------------ weights
    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Tensors to save: everything but the embedding shared with the target."""
        keep_embed = self.config.token_norm_folded  # then the table is LN(E), the drafter's own
        state = {k: v for k, v in self.state_dict().items() if keep_embed or k != "embed_tokens.weight"}
        if self.config.draft_vocab_size == self.config.vocab_size:
            state.pop("d2t"), state.pop("t2d")
        return state

    def save_pretrained(self, path: str | Path, *, layout: Layout = EDSD_TRAINING, dtype: str | None = None) -> None:
        """Write ``config.json`` and ``model.safetensors`` in ``layout`` (training or vLLM)."""
        dtype = dtype or self.config.torch_dtype
        raw = layout.config_json(self.config.with_updates(torch_dtype=dtype))
        tensors = layout.rename_from_canonical(self.trainable_state_dict())
        write_checkpoint(path, raw, cast_floating(tensors, DTYPES[dtype]))

    @classmethod
    def unloaded(cls, path: str | Path) -> tuple[Layout, EDSDDraftModel]:
        """Any EDSD layout (this project's, SpecForge's, vLLM's)."""
        layout, cfg = read_edsd_config(path, tensor_shapes(path))
        return layout, cls(cfg)
