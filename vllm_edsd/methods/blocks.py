"""What the drafters here share, in plain PyTorch: Llama's RMSNorm and RoPE, the draft layer's
attention with the training-time-test key pattern, the SwiGLU MLP, the tensor check, and
``DraftHead``: the frozen target embedding, ``fc``, the final norm, the draft-vocabulary head,
the draft chains (``propose``) and the loading of a drafter directory. Nothing here imports vLLM.

Conventions (the same as EAGLE-3/SpecForge): position ``p`` receives the target feature
``f_p`` (concatenated hidden states at the *input* of the aux target layers) and the token
``x_{p+1}`` and predicts ``x_{p+2}``. The draft layer's attention follows the
training-time-test pattern: step ``k`` at index ``p`` (RoPE position ``p + k``) attends to
the step-0 keys at indices ``<= p`` and to its own index's keys of steps ``1..k``. Serving a
chain of drafts from a context is the special case in which step ``k`` is fed the draft's
own previous prediction, so ``propose`` yields, for every prefix of a sequence at once, the
chain that a serving engine would draft there.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from vllm_edsd.checkpoint.files import SUPPORTED_DTYPES, iter_tensors
from vllm_edsd.checkpoint.layouts import Layout, is_side_tensor, unexpected_hint
from vllm_edsd.errors import EDSDError
from vllm_edsd.methods.draft_config import DEFAULT_ROPE_THETA, DraftConfig

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

    def __init__(self, cfg: DraftConfig, input_size: int | None = None) -> None:
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


def check_tensor_shapes(
    cfg: DraftConfig, shapes: Mapping[str, tuple[int, ...]], layout: Layout,
    model_shapes: Mapping[str, tuple[int, ...]], *, source: str,
) -> None:
    """Refuse a checkpoint whose tensor names or shapes do not fit ``cfg``, naming the tensor
    as the checkpoint names it. The shared embedding is optional unless the token norm is
    folded into it; ``d2t``/``t2d`` are optional when the draft vocabulary is the full one.
    ``model_shapes`` are the canonical shapes of the drafter to load."""
    expected = layout.rename_from_canonical(model_shapes)
    shapes = {name: shape for name, shape in shapes.items() if not is_side_tensor(name)}
    optional = set() if cfg.carries_embedding else {"embed_tokens.weight"}
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


def norm_parts(features: torch.Tensor, norms: Sequence[Callable[[torch.Tensor], torch.Tensor]]) -> torch.Tensor:
    """``features`` cut into ``len(norms)`` equal parts along the last dimension, each normed by
    its own norm, joined again: ``fc``'s input norms, one over all the target features
    (``norm_before_fc``) or one per target layer (``fc_norm``). No norms: the features as they are."""
    if not norms:
        return features
    parts = features.chunk(len(norms), -1)
    return torch.cat([norm(part) for norm, part in zip(norms, parts, strict=True)], -1)


class DraftHead(nn.Module):
    """What every EAGLE-style drafter here has: the target's frozen embedding, ``fc`` over the
    concatenated target features of ``aux_layer_ids`` (vLLM's convention), the final norm, the
    draft-vocab head and the ``d2t``/``t2d`` vocabulary maps; the draft chains (``propose``) and
    the loading of a drafter directory (``from_pretrained``). Subclasses add the draft layer
    (``midlayer``), ``step`` and ``unloaded``."""

    def __init__(self, cfg: DraftConfig, aux_layer_ids: tuple[int, ...], *, norm_before_fc: bool = False,
                 fc_norm: bool = False) -> None:
        super().__init__()
        self.config = cfg
        self.aux_layer_ids = tuple(sorted(aux_layer_ids))  # the target features ``fc`` reads, in this order
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        width, eps = cfg.target_hidden_size, cfg.rms_norm_eps
        # fc's input norms (``FC_INPUT_NORMS``, one of them at most): over all of it, or per target layer
        self.input_norm = RMSNorm(len(aux_layer_ids) * width, eps) if norm_before_fc else None
        self.fc_norm = nn.ModuleList(RMSNorm(width, eps) for _ in aux_layer_ids) if fc_norm else None
        self.fc = nn.Linear(len(aux_layer_ids) * width, cfg.hidden_size, bias=False)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool))

    def fc_input_norms(self) -> list[RMSNorm]:
        """The RMSNorms of ``fc``'s input, each over its equal part of the features: ``input_norm``
        over all of them (``norm_before_fc``), or ``fc_norm``'s one per target layer; none by default."""
        return [self.input_norm] if self.input_norm is not None else list(self.fc_norm or ())

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """``fc`` on the concatenated target features (first draft step only), normed first as
        vLLM's ``combine_hidden_states`` norms them."""
        return self.fc(norm_parts(features, self.fc_input_norms()))

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
        check_tensor_shapes(self.config, {k: tuple(v.shape) for k, v in tensors.items()}, layout, own, source=source)
        weights = {
            k: v for k, v in tensors.items() if not is_side_tensor(k)
        }  # RoPE caches, KV scales: not weights here
        self.load_state_dict({**self.state_dict(), **layout.rename_to_canonical(weights)})

    @classmethod
    def build(cls, cfg: DraftConfig, aux_layer_ids: tuple[int, ...], **switches: bool) -> DraftHead:
        """A new drafter of this method for ``cfg`` reading the target layers ``aux_layer_ids``,
        with the method's draft-layer ``switches`` (``Method.switches``) set."""
        return cls(cfg.with_updates(**switches), aux_layer_ids)

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
