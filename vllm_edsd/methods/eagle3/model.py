"""The EAGLE-3 baseline drafter in plain PyTorch, built from the shared blocks (``methods/blocks.py``),
saved in the layout vLLM's built-in EAGLE-3 method loads (SpecForge names).

Differences from EDSD (docs/formats.md, "EAGLE-3"): ``fc`` reads *three* target layers (3d → d); the
decoder layer's attention reads ``cat[input_layernorm(embedding), hidden_norm(h)]`` (2d) and
its residual is ``h`` taken before ``hidden_norm``; there is no EDFuse. EAGLE 3.1's switches
(``config.py``) change the norms as vLLM's ``Eagle3LlamaForCausalLM`` does, so vLLM's own class
serves every variant.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from vllm_edsd.checkpoint.files import cast_floating, write_checkpoint
from vllm_edsd.checkpoint.layouts import Layout
from vllm_edsd.methods.blocks import DTYPES, DraftAttention, DraftHead, KeyValueSteps, RMSNorm, SwiGLU
from vllm_edsd.methods.draft_config import DraftConfig
from vllm_edsd.methods.eagle3.config import Eagle3Config
from vllm_edsd.methods.eagle3.layouts import EAGLE3_LAYOUT, read_eagle3_config


class Eagle3DecoderLayer(nn.Module):
    """vLLM's first ``LlamaDecoderLayer`` of ``llama_eagle3.py``: attention over the normed token
    and the normed state; ``norm_before_residual`` takes the residual after ``hidden_norm``."""

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.norm_before_residual = cfg.norm_before_residual
        self.hidden_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(d, cfg.rms_norm_eps)
        self.self_attn = DraftAttention(cfg, input_size=2 * d)
        self.post_attention_layernorm = RMSNorm(d, cfg.rms_norm_eps)
        self.mlp = SwiGLU(d, cfg.intermediate_size)

    def forward(
        self, embeds: torch.Tensor, h: torch.Tensor, positions: torch.Tensor, kv: KeyValueSteps
    ) -> torch.Tensor:
        normed = self.hidden_norm(h)
        residual = normed if self.norm_before_residual else h
        x = torch.cat([self.input_layernorm(embeds), normed], -1)
        a = residual + self.self_attn(x, positions, kv)
        return a + self.mlp(self.post_attention_layernorm(a))


class Eagle3DraftModel(DraftHead):
    """Same interface as ``EDSDDraftModel`` (project / step / d2t / propose / from_pretrained) so
    one trainer and one instrument serve both. A plain ``DraftConfig`` is EAGLE-3 with every
    EAGLE 3.1 switch off."""

    def __init__(self, cfg: DraftConfig, aux_layer_ids: tuple[int, int, int]) -> None:
        cfg = Eagle3Config.of(cfg)
        super().__init__(cfg, aux_layer_ids, norm_before_fc=cfg.norm_before_fc, fc_norm=cfg.fc_norm)
        self.midlayer = Eagle3DecoderLayer(cfg)

    @classmethod
    def build(cls, cfg: DraftConfig, aux_layer_ids: tuple[int, ...], **switches: bool) -> Eagle3DraftModel:
        """A new EAGLE-3 drafter for ``cfg``'s draft layer with the EAGLE 3.1 ``switches`` on."""
        return cls(Eagle3Config.of(cfg, **switches), aux_layer_ids)

    def step(self, g: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor, kv: KeyValueSteps):
        """One draft step; ``norm_output`` feeds back the final norm's output instead of its input."""
        a = self.midlayer(self.embed_tokens(input_ids), g, positions, kv)
        normed = self.norm(a)
        return self.lm_head(normed), normed if self.config.norm_output else a

    def save_pretrained(self, path: str | Path, dtype: str | None = None) -> None:
        """config.json + model.safetensors that vLLM's EAGLE-3 loader reads as they are."""
        cfg = self.config
        dtype = dtype or cfg.torch_dtype
        ids = list(self.aux_layer_ids)
        raw = cfg.llama_fields()
        raw.update(
            architectures=[EAGLE3_LAYOUT.architecture],
            torch_dtype=dtype,
            **cfg.switches(),  # every one written: a speculators reader's defaults differ (config.py)
            eagle_aux_hidden_state_layer_ids=ids,
            eagle_config={"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
        )
        tensors = {k: v for k, v in self.state_dict().items() if k != "embed_tokens.weight"}
        if cfg.draft_vocab_size == cfg.vocab_size:  # vLLM then has no draft-to-target map to load
            tensors.pop("d2t"), tensors.pop("t2d")
        write_checkpoint(path, raw, cast_floating(tensors, DTYPES[dtype]))

    @classmethod
    def unloaded(cls, path: str | Path) -> tuple[Layout, Eagle3DraftModel]:
        """An EAGLE-3 drafter directory in the layout vLLM's EAGLE-3 method loads."""
        cfg, aux_layer_ids = read_eagle3_config(path)
        return EAGLE3_LAYOUT, cls(cfg, aux_layer_ids)
