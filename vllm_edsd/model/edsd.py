"""The EDSD draft model in plain PyTorch: the one definition of the architecture
(docs/architecture.md, "The EDSD draft model").

Training, the converter's validation, the offline acceptance predictor and the parity tests
all use this module; ``vllm_model.py`` mirrors it with vLLM's parallel layers. It imports
nothing from vLLM.

Conventions (the same as EAGLE-3/SpecForge): position ``p`` receives the target feature
``f_p`` (concatenated hidden states at the *input* of two target layers) and the token
``x_{p+1}`` and predicts ``x_{p+2}``. Later draft steps feed back the decoder layer's
pre-norm output instead of ``fc(f_p)``. The draft layer's attention follows the
training-time-test pattern: step ``k`` at index ``p`` (RoPE position ``p + k``) attends to
the step-0 keys at indices ``<= p`` and to its own index's keys of steps ``1..k``. Serving a
chain of drafts from a context is the special case in which step ``k`` is fed the draft's
own previous prediction, so ``propose`` yields, for every prefix of a sequence at once, the
chain that a serving engine would draft there.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from vllm_edsd.checkpoint.config import DEFAULT_ROPE_THETA, LAYERNORM, SUPPORTED_DTYPES, EDSDConfig
from vllm_edsd.checkpoint.files import cast_floating, iter_tensors, tensor_shapes, write_checkpoint
from vllm_edsd.checkpoint.layouts import EDSD_TRAINING, Layout, is_side_tensor, read_drafter_config, unexpected_hint
from vllm_edsd.errors import EDSDError
from vllm_edsd.model import float16_range

DTYPES = {name: getattr(torch, name) for name in SUPPORTED_DTYPES}  # name -> torch dtype


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inverse_frequencies(head_dim: int, params: dict) -> torch.Tensor:
    """Inverse frequencies of Llama RoPE: default, linear and llama3 scaling."""
    theta = float(params.get("rope_theta", DEFAULT_ROPE_THETA))
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    kind = params.get("rope_type", "default")
    if kind == "linear":
        inv_freq = inv_freq / float(params["factor"])
    elif kind == "llama3":
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_len = float(params["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        mid = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        is_mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        inv_freq = torch.where(is_mid, mid, scaled)
    return inv_freq.float()


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Neox-style rotation of ``x`` [B, heads, T, head_dim] at ``positions`` [B, T]."""
    angles = positions.to(torch.float32)[..., None] * inv_freq.to(x.device)  # [B, T, hd/2]
    cos = torch.cat([angles.cos(), angles.cos()], -1)[:, None].to(x.dtype)
    sin = torch.cat([angles.sin(), angles.sin()], -1)[:, None].to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


class KeyValueSteps:
    """Draft-layer keys and values per training-time-test step (step 0 first)."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []


class DraftAttention(nn.Module):
    """Llama attention with the training-time-test key pattern. ``input_size`` differs from
    the hidden size only for EAGLE-3, whose attention reads [embedding, feature] (2d)."""

    def __init__(self, cfg: EDSDConfig, input_size: int | None = None) -> None:
        super().__init__()
        d, hd = cfg.hidden_size, cfg.head_dim
        d_in = input_size or d
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.q_proj = nn.Linear(d_in, self.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(d_in, self.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(d_in, self.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.num_heads * hd, d, bias=False)
        self.register_buffer("inv_freq", rope_inverse_frequencies(hd, cfg.rope_parameters), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv: KeyValueSteps) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, positions, self.inv_freq), apply_rope(k, positions, self.inv_freq)
        groups = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        kv.keys.append(k)
        kv.values.append(v)
        scale = 1.0 / math.sqrt(self.head_dim)
        # Step-0 keys, causal over indices; then one same-index key per later step.
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        scores = [(q @ kv.keys[0].transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))]
        scores += [(q * key).sum(-1, keepdim=True) * scale for key in kv.keys[1:]]
        weights = torch.softmax(torch.cat(scores, -1).float(), -1).to(q.dtype)
        out = weights[..., :t] @ kv.values[0]
        for i, value in enumerate(kv.values[1:]):
            out = out + weights[..., t + i : t + i + 1] * value
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class SwiGLU(nn.Module):
    def __init__(self, size: int, inner: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(size, inner, bias=False)
        self.up_proj = nn.Linear(size, inner, bias=False)
        self.down_proj = nn.Linear(inner, size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftDecoderLayer(nn.Module):
    """One Llama decoder layer whose input is the EDFuse output (size d, not 2d)."""

    def __init__(self, cfg: EDSDConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DraftAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, u: torch.Tensor, positions: torch.Tensor, kv: KeyValueSteps) -> torch.Tensor:
        dtype = self.input_layernorm.weight.dtype
        if u.dtype != dtype:  # a float32 stream around a float16 layer (float16_range.py)
            return float16_range.decoder_layer(
                u, lambda x: self.self_attn(x, positions, kv), self.mlp,
                (self.input_layernorm.weight, self.input_layernorm.eps),
                (self.post_attention_layernorm.weight, self.post_attention_layernorm.eps), dtype,
            )
        a = u + self.self_attn(self.input_layernorm(u), positions, kv)
        return a + self.mlp(self.post_attention_layernorm(a))


def token_norm(cfg: EDSDConfig) -> nn.Module:
    """EDFuse's norm of the token embedding: SpecForge's RMSNorm or the paper's LayerNorm."""
    if cfg.token_norm == LAYERNORM:
        return nn.LayerNorm(cfg.hidden_size, eps=cfg.token_norm_eps)
    return RMSNorm(cfg.hidden_size, cfg.token_norm_eps)


class EDFuse(nn.Module):
    """``down(silu(gate(g)) * up(norm(e)))``: gated fusion of feature and token streams.
    A folded drafter's embedding table already holds ``norm(e)``."""

    def __init__(self, cfg: EDSDConfig) -> None:
        super().__init__()
        d, m = cfg.hidden_size, cfg.fuse_intermediate_size
        self.gate_proj = nn.Linear(d, m, bias=False)
        self.up_proj = nn.Linear(d, m, bias=False)
        self.down_proj = nn.Linear(m, d, bias=False)
        self.token_norm = None if cfg.token_norm_folded else token_norm(cfg)

    def forward(self, g: torch.Tensor, token_embeds: torch.Tensor) -> torch.Tensor:
        e = token_embeds if self.token_norm is None else self.token_norm(token_embeds)
        dtype = self.gate_proj.weight.dtype
        if g.dtype != dtype:  # a float32 feature beside float16 weights (float16_range.py)
            return float16_range.fuse(g, e, self.gate_proj, self.up_proj, self.down_proj, dtype)
        return self.down_proj(F.silu(self.gate_proj(g)) * self.up_proj(e))


def expected_shapes(cfg: EDSDConfig) -> dict[str, tuple[int, ...]]:
    """Full (unsharded) shape of every tensor a drafter with this config may carry,
    under training-layout names; derived from the model itself on the meta device."""
    with torch.device("meta"):
        model = EDSDDraftModel(cfg)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def check_tensors(
    cfg: EDSDConfig, shapes: Mapping[str, tuple[int, ...]], layout: Layout, *, source: str,
    model_shapes: Mapping[str, tuple[int, ...]] | None = None,
) -> None:
    """Refuse a checkpoint whose tensor names or shapes do not fit ``cfg``, naming the tensor
    as the checkpoint names it. The shared embedding is optional unless the token norm is
    folded into it; ``d2t``/``t2d`` are optional when the draft vocabulary is the full one.
    ``model_shapes`` are the canonical shapes of the drafter to load (default: EDSD's for ``cfg``;
    an EAGLE-3 drafter passes its own)."""
    expected = layout.rename_from_canonical(model_shapes or expected_shapes(cfg))
    shapes = {name: shape for name, shape in shapes.items() if not is_side_tensor(name)}
    optional = set() if cfg.token_norm_folded else {"embed_tokens.weight"}
    if cfg.draft_vocab_size == cfg.vocab_size:
        optional |= {"d2t", "t2d"}
    missing = sorted(set(expected) - set(shapes) - optional)
    unexpected = sorted(set(shapes) - set(expected))
    if unexpected:
        hints = "".join(dict.fromkeys(unexpected_hint(name) for name in unexpected))
        raise EDSDError(f"{source}: unexpected tensor(s): {', '.join(unexpected)}{hints}")
    if missing:
        raise EDSDError(f"{source}: missing tensor(s): {', '.join(missing)}")
    for name, shape in shapes.items():
        if tuple(shape) != expected[name]:
            hint = ""
            if name == "fc.weight" and len(shape) == 2 and shape[1] == 3 * cfg.target_hidden_size:
                hint = " (fc reads three target layers: this looks like an EAGLE-3 checkpoint; EDSD reads two)"
            raise EDSDError(f"{source}: tensor '{name}' has shape {list(shape)}, expected {list(expected[name])}{hint}")


def draft_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of each row's softmax, at temperature 1; -inf logits (tokens outside
    the draft vocabulary, in vLLM's target-vocab logits) contribute nothing."""
    return torch.special.entr(torch.softmax(logits.float(), dim=-1)).sum(dim=-1)


class DraftHead(nn.Module):
    """What every EAGLE-style drafter here has: the target's frozen embedding, ``fc`` over the
    concatenated target features of ``aux_layer_ids`` (vLLM's convention), the final norm, the
    draft-vocab head and the ``d2t``/``t2d`` vocabulary maps; the draft chains (``propose``) and
    the loading of a drafter directory (``from_pretrained``). Subclasses add the draft layer
    (``midlayer``), ``step`` and ``unloaded``."""

    def __init__(self, cfg: EDSDConfig, aux_layer_ids: tuple[int, ...]) -> None:
        super().__init__()
        self.config = cfg
        self.aux_layer_ids = tuple(sorted(aux_layer_ids))  # the target features ``fc`` reads, in this order
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(len(aux_layer_ids) * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool))

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """``fc`` on the concatenated target features (first draft step only)."""
        return self.fc(features)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def step(
        self, g: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor, kv: KeyValueSteps
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step: returns (draft-vocab logits, pre-norm output fed back next step)."""
        raise NotImplementedError

    # ------------------------------------------------------------ draft chains
    @torch.no_grad()
    def propose(self, features: torch.Tensor, next_tokens: torch.Tensor, num_steps: int) -> torch.Tensor:
        """Greedy draft chains for every prefix at once.

        ``features`` [B, T, n·d_t] are the target features of positions 0..T-1 and
        ``next_tokens`` [B, T] the tokens x_1..x_T. Returns target-vocab ids [B, T, K]:
        row p is the chain an engine drafts when the context ends with x_{p+1}.
        """
        return self.propose_with_entropy(features, next_tokens, num_steps)[0]

    @torch.no_grad()
    def propose_with_entropy(
        self, features: torch.Tensor, next_tokens: torch.Tensor, num_steps: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``propose``, plus the entropy (nats) of each drafted token's distribution [B, T, K]:
        what the adaptive draft length decides on."""
        b, t = next_tokens.shape
        positions = torch.arange(t, device=next_tokens.device).expand(b, t)
        kv = KeyValueSteps()
        g, tokens, chain, entropy = self.project(features), next_tokens, [], []
        for k in range(num_steps):
            logits, g = self.step(g, tokens, positions + k, kv)
            tokens = self.draft_to_target(logits.argmax(-1))
            chain.append(tokens)
            entropy.append(draft_entropy(logits))
        return torch.stack(chain, -1), torch.stack(entropy, -1)

    @torch.no_grad()
    def first_draft_logits(self, features: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits of the first draft step for every prefix [B, T, V_d]; rows
        as in ``propose``."""
        b, t = next_tokens.shape
        positions = torch.arange(t, device=next_tokens.device).expand(b, t)
        return self.step(self.project(features), next_tokens, positions, KeyValueSteps())[0]

    # ------------------------------------------------------------ weights
    def load_tensors(self, tensors: dict[str, torch.Tensor], layout: Layout, *, source: str) -> None:
        """Load a checkpoint's tensors (``layout``'s names); every parameter exactly once."""
        own = {name: tuple(tensor.shape) for name, tensor in self.state_dict().items()}
        check_tensors(self.config, {k: tuple(v.shape) for k, v in tensors.items()}, layout, source=source,
                      model_shapes=own)
        weights = {
            k: v for k, v in tensors.items() if not is_side_tensor(k)
        }  # RoPE caches, KV scales: not weights here
        self.load_state_dict({**self.state_dict(), **layout.rename_to_canonical(weights)})

    @classmethod
    def unloaded(cls, path: str | Path) -> tuple[Layout, DraftHead]:
        """The layout of the drafter directory ``path`` and a drafter of its shape, weights not loaded yet."""
        raise NotImplementedError

    @classmethod
    def from_pretrained(
        cls, path: str | Path, *, embed_tokens: torch.Tensor | None = None, dtype: torch.dtype = torch.float32
    ) -> DraftHead:
        """Load a drafter directory (the layouts ``unloaded`` reads). ``embed_tokens`` is the
        target's embedding table, used unless the checkpoint carries a table of its own."""
        layout, model = cls.unloaded(path)
        tensors = dict(iter_tensors(path))
        if "embed_tokens.weight" not in tensors:
            if embed_tokens is None:
                raise EDSDError(f"{path}: the drafter shares the target's embedding; pass the target's table")
            tensors["embed_tokens.weight"] = embed_tokens
        model.load_tensors(tensors, layout, source=str(path))
        return model.to(dtype).eval()


class EDSDDraftModel(DraftHead):
    """The EDSD drafter. Parameter names are those of the training layout (docs/formats.md, "Training layout")."""

    def __init__(self, cfg: EDSDConfig) -> None:
        super().__init__(cfg, cfg.aux_layer_ids)
        self.edfuse = EDFuse(cfg)
        self.midlayer = DraftDecoderLayer(cfg)

    @property
    def wide_stream(self) -> bool:
        """Whether the residual stream runs in float32 beside the weights (float16_range.py)."""
        return float16_range.needs_wide_stream(self.fc.weight.dtype)

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """``fc`` on the concatenated target features, as ``step`` reads its fed-back state."""
        if not self.wide_stream:
            return self.fc(features)
        return float16_range.project(self.fc, features, self.fc.weight.dtype)

    def step(
        self, g: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor, kv: KeyValueSteps
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step: returns (draft-vocab logits, pre-norm output fed back next step)."""
        if not self.wide_stream:
            a = self.midlayer(self.edfuse(g, self.embed_tokens(input_ids)), positions, kv)
            return self.lm_head(self.norm(a)), a
        dtype = self.fc.weight.dtype
        u = self.edfuse(float16_range.load_state(g), self.embed_tokens(input_ids))
        a = self.midlayer(u, positions, kv)
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
        layout, cfg = read_drafter_config(path, tensor_shapes(path))
        return layout, cls(cfg)
