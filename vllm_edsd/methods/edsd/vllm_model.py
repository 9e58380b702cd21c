"""The EDSD draft model for vLLM, mirroring ``model.py`` with vLLM's parallel layers.

It subclasses vLLM's ``Eagle3LlamaForCausalLM`` because the EAGLE proposer asserts that
type; it inherits ``compute_logits`` (draft-vocab scatter through ``d2t``) and
``embed_input_ids``, and replaces the rest:

* ``combine_hidden_states``: ``fc`` on the two aux hidden states (first draft step only), normed
  first where ``norm_before_fc`` or ``fc_norm`` asks, as vLLM's EAGLE-3 does;
* ``forward``: EDFuse on (feature, token embedding), one stock Llama decoder layer, RMSNorm;
  it returns (normed states for the logits, pre-norm states fed back to the next step). In
  float16 the residual stream runs in float32 and the fed-back state is stored compressed
  (``float16_range.py``): float16's range is too short for EDSD's unnormalised stream;
* ``compute_logits`` (and ``draft_vocab_logits``, the draft vocabulary's alone, which greedy
  drafting reads: ``serving/draft_vocab.py``) also records the draft entropy when the adaptive
  draft length asks for it (``serving/features/draft_length.py`` sets ``record_draft_entropy``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.distributed.communication_op import tensor_model_parallel_all_reduce
from vllm.distributed.parallel_state import get_tensor_model_parallel_world_size
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader, maybe_remap_kv_scale_name
from vllm.model_executor.models.llama import LlamaDecoderLayer
from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM
from vllm.model_executor.models.utils import WeightsMapper, get_draft_quant_config, maybe_prefix, process_eagle_weight

import vllm_edsd.methods.edsd.float16_range as float16_range
from vllm_edsd.checkpoint.layouts import KV_SCALE, ROPE_CACHES, unexpected_hint
from vllm_edsd.checkpoint.target import TargetFingerprint
from vllm_edsd.errors import EDSDError
from vllm_edsd.methods.blocks import draft_entropy, norm_parts
from vllm_edsd.methods.edsd.config import LAYERNORM, EDSDConfig
from vllm_edsd.methods.edsd.layouts import EDSD_VLLM
from vllm_edsd.methods.edsd.model import expected_shapes

# vLLM-layout tensor name -> parameter name; names not listed (``lm_head.*``) keep theirs, and
# ``t2d`` is dropped: ``d2t`` alone maps the vocabulary.
_CHECKPOINT_TO_PARAMS = WeightsMapper(
    orig_to_new_prefix={
        "midlayer.": "model.layers.0.",
        "fc.": "model.fc.",
        "input_norm.": "model.input_norm.",
        "fc_norm.": "model.fc_norm.",
        "edfuse.": "model.edfuse.",
        "norm.": "model.norm.",
        "embed_tokens.": "model.embed_tokens.",
        "d2t": "draft_id_to_target_id",
        "t2d": None,
    }
)
# Parameter name -> (fused parameter name, shard id) for vLLM's fused projections.
_STACKED = {
    ".self_attn.q_proj.": (".self_attn.qkv_proj.", "q"),
    ".self_attn.k_proj.": (".self_attn.qkv_proj.", "k"),
    ".self_attn.v_proj.": (".self_attn.qkv_proj.", "v"),
    ".mlp.gate_proj.": (".mlp.gate_up_proj.", 0),
    ".mlp.up_proj.": (".mlp.gate_up_proj.", 1),
}


def _checkpoint_to_param(name: str, params: dict) -> tuple[str | None, object]:
    """(parameter name or None to skip, shard id or None) of a vLLM-layout tensor.

    Skipped like vLLM's own loaders skip them: ``t2d``, RoPE caches, and KV-cache scales
    when the drafter's KV cache is not quantized (vLLM's ``maybe_remap_kv_scale_name``
    maps them onto the attention layer when it is)."""
    if name.endswith(ROPE_CACHES):
        return None, None
    mapped = _CHECKPOINT_TO_PARAMS.apply_list([name])  # the one lookup vLLM 0.24-0.33 all have
    if not mapped:
        return None, None
    param = mapped[0]
    if KV_SCALE.search(param):
        return maybe_remap_kv_scale_name(param, params), None
    for unfused, (fused, shard) in _STACKED.items():
        if unfused in param:
            return param.replace(unfused, fused), shard
    return param, None


class EDSDDecoderLayer(LlamaDecoderLayer):
    """vLLM's Llama decoder layer, quantized like the drafter rather than the target; its
    attention reads ``input_layernorm(u)`` (the paper's design), its residual is ``u``, or
    ``input_layernorm(u)`` with ``norm_before_residual``."""

    def __init__(self, vllm_config: VllmConfig, *, edsd: EDSDConfig, prefix: str, config) -> None:
        super().__init__(vllm_config, prefix=prefix, config=config)
        self.norm_before_residual = edsd.norm_before_residual

    def get_quant_config(self, vllm_config: VllmConfig) -> QuantizationConfig | None:
        return get_draft_quant_config(vllm_config)

    def attention_input(self, normed: torch.Tensor, token_embeds: torch.Tensor) -> torch.Tensor:
        return normed

    def forward_fused(
        self, positions: torch.Tensor, u: torch.Tensor, token_embeds: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(MLP output, residual) of the EDFuse output ``u``, as vLLM's decoder layers return them."""
        normed = self.input_layernorm(u)
        attn = self.self_attn(positions=positions, hidden_states=self.attention_input(normed, token_embeds))
        hidden, residual = self.post_attention_layernorm(attn, normed if self.norm_before_residual else u)
        return self.mlp(hidden), residual


class TokenReadingDecoderLayer(EDSDDecoderLayer):
    """The decoder layer of ``attention_reads_token``: q/k/v read ``[input_layernorm(u);
    token_norm(e)]`` (2d, a wider fused projection as vLLM's EAGLE-3 layer has)."""

    def __init__(self, vllm_config: VllmConfig, *, edsd: EDSDConfig, prefix: str, config) -> None:
        super().__init__(vllm_config, edsd=edsd, prefix=prefix, config=config)
        self.self_attn.qkv_proj = QKVParallelLinear(
            2 * edsd.hidden_size, edsd.head_dim, edsd.num_attention_heads, edsd.num_key_value_heads, bias=False,
            quant_config=self.get_quant_config(vllm_config), prefix=maybe_prefix(prefix, "self_attn.qkv_proj"),
        )
        self.token_norm = RMSNorm(edsd.hidden_size, eps=edsd.rms_norm_eps)

    def attention_input(self, normed: torch.Tensor, token_embeds: torch.Tensor) -> torch.Tensor:
        return torch.cat([normed, self.token_norm(token_embeds)], -1)


class EDFuse(nn.Module):
    """``down(silu(gate(g)) * up(norm(e)))``, plus ``g`` with ``fuse_residual``; gate/up
    column-parallel, down row-parallel. The down projection's partial sums are reduced here,
    after a float32 stream's rescaling (``float16_range.fuse`` scales each rank's shard by its
    own power of two), and before ``g``, which every rank holds whole, is added."""

    def __init__(self, edsd: EDSDConfig, quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        d, m = edsd.hidden_size, edsd.fuse_intermediate_size
        self.feature_gate = ColumnParallelLinear(
            d, m, bias=False, quant_config=quant_config, prefix=f"{prefix}.feature_gate", return_bias=False
        )
        self.token_up = ColumnParallelLinear(
            d, m, bias=False, quant_config=quant_config, prefix=f"{prefix}.token_up", return_bias=False
        )
        self.fuse_down = RowParallelLinear(
            m, d, bias=False, quant_config=quant_config, prefix=f"{prefix}.fuse_down", return_bias=False,
            reduce_results=False,
        )
        self.tp_size = get_tensor_model_parallel_world_size()
        self.feature_norm = RMSNorm(d, eps=edsd.rms_norm_eps) if edsd.feature_norm else None
        self.fuse_residual = edsd.fuse_residual
        self.token_norm = None
        if not edsd.token_norm_folded:
            norm = nn.LayerNorm if edsd.token_norm == LAYERNORM else RMSNorm
            self.token_norm = norm(d, eps=edsd.token_norm_eps)

    def forward(self, features: torch.Tensor, token_embeds: torch.Tensor) -> torch.Tensor:
        if self.token_norm is not None:
            token_embeds = self.token_norm(token_embeds)
        if self.feature_norm is not None:
            features = (self.feature_norm(features) if features.dtype == token_embeds.dtype else
                        float16_range.rms_norm(features, self.feature_norm.weight, self.feature_norm.variance_epsilon))
        if features.dtype == token_embeds.dtype:
            fused = self.fuse_down(F.silu(self.feature_gate(features)) * self.token_up(token_embeds))
        else:  # a float32 stream beside float16 weights
            fused = float16_range.fuse(
                features, token_embeds, self.feature_gate, self.token_up, self.fuse_down, token_embeds.dtype
            )
        fused = tensor_model_parallel_all_reduce(fused) if self.tp_size > 1 else fused
        return features + fused if self.fuse_residual else fused


@support_torch_compile(
    dynamic_arg_dims={"input_ids": 0, "positions": -1, "hidden_states": 0, "input_embeds": 0}
)
class EDSDLlamaModel(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, edsd: EDSDConfig, start_layer_id: int, prefix: str = "") -> None:
        super().__init__()
        self.config = vllm_config.speculative_config.draft_model_config.hf_config
        quant_config = get_draft_quant_config(vllm_config)
        self.embed_tokens = VocabParallelEmbedding(
            edsd.vocab_size, edsd.hidden_size, prefix=maybe_prefix(prefix, "embed_tokens")
        )
        width, eps = edsd.target_hidden_size, edsd.rms_norm_eps
        # fc's input norms (EDSDConfig.norm_before_fc / fc_norm), named as vLLM's EAGLE-3 names them
        self.input_norm = RMSNorm(2 * width, eps=eps) if edsd.norm_before_fc else None
        self.fc_norm = nn.ModuleList(RMSNorm(width, eps=eps) for _ in range(2)) if edsd.fc_norm else None
        self.fc = ReplicatedLinear(
            2 * width,
            edsd.hidden_size,
            bias=False,
            params_dtype=vllm_config.model_config.dtype,
            quant_config=quant_config,
            prefix=maybe_prefix(prefix, "fc"),
            return_bias=False,
        )
        self.edfuse = EDFuse(edsd, quant_config, maybe_prefix(prefix, "edfuse"))
        # The attention prefix must not collide with any target layer's.
        layer_prefix = maybe_prefix(prefix, f"layers.{start_layer_id}")
        layer_class = TokenReadingDecoderLayer if edsd.attention_reads_token else EDSDDecoderLayer
        layer = layer_class(get_current_vllm_config(), edsd=edsd, prefix=layer_prefix, config=self.config)
        self.layers = nn.ModuleList([layer])
        self.norm = RMSNorm(edsd.hidden_size, eps=edsd.rms_norm_eps)
        self.dtype = vllm_config.model_config.dtype
        self.wide_stream = float16_range.needs_wide_stream(self.dtype)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def fc_input_norms(self) -> list[RMSNorm]:
        """``fc``'s input norms, each over its equal part of the features (``blocks.norm_parts``):
        ``input_norm`` over both target layers, or ``fc_norm``'s one per layer; none by default."""
        return [self.input_norm] if self.input_norm is not None else list(self.fc_norm or ())

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """``fc`` on the target's features, normed first where a switch asks; in float16 the
        norms run in float32 before the features are scaled (``float16_range.project``)."""
        norms = self.fc_input_norms()
        if not self.wide_stream:
            return self.fc(norm_parts(features, norms))
        return float16_range.project(self.fc, features, self.dtype,
                                     [(norm.weight, norm.variance_epsilon) for norm in norms])

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        input_embeds: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if input_embeds is None:
            input_embeds = self.embed_input_ids(input_ids)
        if self.wide_stream:
            return self.forward_float32_stream(positions, float16_range.load_state(hidden_states), input_embeds)
        hidden_states, residual = self.layers[0].forward_fused(positions, self.edfuse(hidden_states, input_embeds),
                                                               input_embeds)
        normed, prenorm = self.norm(hidden_states, residual)
        return normed, prenorm

    def forward_float32_stream(
        self, positions: torch.Tensor, state: torch.Tensor, input_embeds: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` on a float32 residual stream around the float16 layers; the fed-back
        state is returned as ``float16_range.store_state`` holds it."""
        layer = self.layers[0]
        prenorm = float16_range.decoder_layer(
            self.edfuse(state, input_embeds),
            lambda x: layer.self_attn(positions=positions, hidden_states=layer.attention_input(x, input_embeds)),
            layer.mlp,
            (layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon),
            (layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon),
            self.dtype,
            layer.norm_before_residual,
        )
        normed = float16_range.rms_norm(prenorm, self.norm.weight, self.norm.variance_epsilon).to(self.dtype)
        return normed, float16_range.store_state(prenorm, self.dtype)


class EDSDLlamaForCausalLM(Eagle3LlamaForCausalLM):
    """EDSD drafter served through vLLM's EAGLE-3 proposer (``"method": "edsd"``)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        nn.Module.__init__(self)
        self.config = vllm_config.speculative_config.draft_model_config.hf_config
        self.edsd = EDSDConfig.from_dict(self.config.to_dict(), source="draft config")
        target_config = vllm_config.model_config.hf_text_config
        self.edsd.check_target(TargetFingerprint.from_hf_config(target_config))
        target_layers = vllm_config.model_config.get_total_num_hidden_layers()
        self.config.draft_vocab_size = self.edsd.draft_vocab_size
        self.config.target_layer_count = target_layers
        self.model = EDSDLlamaModel(
            vllm_config=vllm_config, edsd=self.edsd, start_layer_id=target_layers, prefix=maybe_prefix(prefix, "model")
        )
        self.lm_head = ParallelLMHead(
            self.edsd.draft_vocab_size,
            self.edsd.hidden_size,
            quant_config=get_draft_quant_config(vllm_config),
            prefix=maybe_prefix(prefix, "lm_head"),
        )
        self.logits_processor = LogitsProcessor(self.edsd.draft_vocab_size)
        self.draft_id_to_target_id = (
            nn.Parameter(torch.zeros(self.edsd.draft_vocab_size, dtype=torch.long), requires_grad=False)
            if self.edsd.draft_vocab_size != self.edsd.vocab_size
            else None
        )
        self.checkpoint_shapes = EDSD_VLLM.rename_from_canonical(expected_shapes(self.edsd))
        self.use_parallel_drafting = vllm_config.speculative_config.parallel_drafting
        if self.use_parallel_drafting:
            raise EDSDError("EDSD drafters do not support parallel_drafting; remove it from the speculative config")
        self.record_draft_entropy = False  # set by the adaptive draft length, which reads the entropy
        self.last_draft_entropy: torch.Tensor | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model(input_ids, positions, hidden_states, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.entropy_recorded(super().compute_logits(hidden_states))

    def draft_vocab_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """The logits over the draft vocabulary alone, which greedy drafting reads
        (``serving/draft_vocab.py``); their entropy is the scattered logits' own."""
        return self.entropy_recorded(self.logits_processor(self.lm_head, hidden_states))

    def get_top_tokens(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Greedy drafts under vLLM's ``use_local_argmax_reduction`` (V1 and V2 runners): each
        tensor-parallel rank's argmax over its shard of the draft vocabulary, reduced by vLLM,
        mapped to the target's ids; no logits of the target vocabulary's size are made."""
        draft_ids = self.logits_processor.get_top_tokens(self.lm_head, hidden_states)
        if self.draft_id_to_target_id is None:
            return draft_ids
        return draft_ids + self.draft_id_to_target_id[draft_ids]

    def entropy_recorded(self, logits: torch.Tensor | None) -> torch.Tensor | None:
        if self.record_draft_entropy and logits is not None:
            self.last_draft_entropy = draft_entropy(logits)
        return logits

    def combine_hidden_states(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.model.project(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        # The attention layer's own parameters are KV-cache scales: optional, 1.0 by default.
        expected = {n for n in params if ".attn." not in n} - {"model.embed_tokens.weight"}
        if self.draft_id_to_target_id is None:
            expected.discard("draft_id_to_target_id")
        loaded: set[str] = set()
        for name, tensor in weights:
            param_name, shard = _checkpoint_to_param(name, params)
            if param_name is None or (name == "d2t" and self.draft_id_to_target_id is None):
                continue
            if param_name not in params:
                raise EDSDError(f"EDSD drafter: unexpected tensor '{name}' in checkpoint{unexpected_hint(name)}")
            want = self.checkpoint_shapes.get(name)
            if want is not None and tuple(tensor.shape) != want:
                raise EDSDError(f"EDSD drafter: tensor '{name}' has shape {list(tensor.shape)}, expected {list(want)}")
            param = params[param_name]
            loader = getattr(param, "weight_loader", default_weight_loader)
            if shard is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard)
            loaded.add(param_name)
            process_eagle_weight(self, param_name)
        missing = sorted(expected - loaded)
        if missing:
            raise EDSDError(f"EDSD drafter: checkpoint lacks tensor(s) for {', '.join(missing)}")
        return loaded | {"model.embed_tokens.weight"}
