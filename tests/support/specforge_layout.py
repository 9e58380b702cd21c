"""SpecForge's EDSD drafter, written here from what SpecForge's code defines (the names and the
config of ``specforge/modeling/draft/edsd.py`` and a saved ``epoch_*_step_*`` folder, see
``shared/SPECFORGE_EDSD.md``) and *not* through this project's layouts, so that the converter
and the reference model are checked against an independent reading:

* ``write_specforge_checkpoint``: a random ``EdsdDraftModel`` checkpoint for a toy target;
* ``specforge_chains``: its greedy draft chains, computed the way SpecForge's modules compute
  them (``fc``; ``embnorm`` RMSNorm; ``edfuse`` = down(silu(gate(h)) * up(embnorm(e))); the
  midlayer with ``hidden_norm`` and SpecForge's training-time-test key cache; ``norm``;
  ``lm_head``; ``d2t`` offsets).
"""

from __future__ import annotations

import json
import math
import pickle
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

ARCHITECTURE = "EdsdDraftModel"


class _WritesMarkerWhenUnpickled:
    """Stands in for ``training_state.pt``: unpickling it creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def write_specforge_checkpoint(
    target_dir: str | Path,
    out: Path,
    *,
    target_layer_ids: list[int] = (0, 2),
    draft_vocab_size: int = 256,
    with_embedding: bool = False,
    sharded: bool = False,
    seed: int = 0,
    weights: dict[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """An ``epoch_0_step_100``-style folder: config.json, model.safetensors (or two shards with an
    index), and a ``training_state.pt`` that must never be unpickled. Returns the tensors:
    random, or ``weights`` (SpecForge's names) where given."""
    target = json.loads((Path(target_dir) / "config.json").read_text())
    config = specforge_config(target, list(target_layer_ids), draft_vocab_size)
    tensors = dict(weights) if weights is not None else random_specforge_weights(config, seed)
    if with_embedding:
        from safetensors import safe_open

        with safe_open(str(Path(target_dir) / "model.safetensors"), framework="pt") as f:
            tensors["embed_tokens.weight"] = f.get_tensor("model.embed_tokens.weight")
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    if sharded:
        names = sorted(tensors)
        weight_map = {}
        for i, part in enumerate((names[::2], names[1::2])):
            file = f"model-{i + 1:05d}-of-00002.safetensors"
            save_file({n: tensors[n].contiguous() for n in part}, str(out / file))
            weight_map.update({n: file for n in part})
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    else:
        save_file({n: t.contiguous() for n, t in tensors.items()}, str(out / "model.safetensors"))
    (out / "training_state.pt").write_bytes(pickle.dumps(_WritesMarkerWhenUnpickled(out / "UNPICKLED")))
    return tensors


def specforge_config(target: dict, target_layer_ids: list[int], draft_vocab_size: int) -> dict:
    """SpecForge's config.json of an EDSD drafter for ``target`` (the target's config)."""
    d, heads = target["hidden_size"], target["num_attention_heads"]
    return {
        "architectures": [ARCHITECTURE], "model_type": "llama", "hidden_act": "silu", "attention_bias": False,
        "hidden_size": d, "intermediate_size": target["intermediate_size"], "num_attention_heads": heads,
        "num_key_value_heads": target["num_key_value_heads"], "head_dim": target.get("head_dim") or d // heads,
        "num_hidden_layers": 1, "rms_norm_eps": target.get("rms_norm_eps", 1e-6),
        "rope_theta": target.get("rope_theta", (target.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
        "rope_scaling": None, "max_position_embeddings": target["max_position_embeddings"],
        "vocab_size": target["vocab_size"], "draft_vocab_size": draft_vocab_size, "tie_word_embeddings": False,
        "torch_dtype": "float32", "target_layer_ids": target_layer_ids,
    }


def random_specforge_weights(config: dict, seed: int) -> dict[str, torch.Tensor]:
    """Random weights of every tensor a SpecForge EDSD checkpoint holds, by SpecForge's names."""
    d, m, vocab, draft_vocab_size = (config[k] for k in ("hidden_size", "intermediate_size", "vocab_size",
                                                         "draft_vocab_size"))
    q_width, kv_width = config["num_attention_heads"] * config["head_dim"], \
        config["num_key_value_heads"] * config["head_dim"]
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.05):
        return torch.randn(*shape, generator=g) * scale

    def norm_weight():
        return 0.5 + torch.rand(d, generator=g)

    used = torch.linspace(0, vocab - 1, draft_vocab_size).round().long()
    return {
        "fc.weight": rand(d, 2 * d),
        "embnorm.weight": norm_weight(),
        "edfuse.gate_proj.weight": rand(m, d),
        "edfuse.up_proj.weight": rand(m, d),
        "edfuse.down_proj.weight": rand(d, m),
        "midlayer.hidden_norm.weight": norm_weight(),
        "midlayer.self_attn.q_proj.weight": rand(q_width, d),
        "midlayer.self_attn.k_proj.weight": rand(kv_width, d),
        "midlayer.self_attn.v_proj.weight": rand(kv_width, d),
        "midlayer.self_attn.o_proj.weight": rand(d, q_width),
        "midlayer.post_attention_layernorm.weight": norm_weight(),
        "midlayer.mlp.gate_proj.weight": rand(m, d),
        "midlayer.mlp.up_proj.weight": rand(m, d),
        "midlayer.mlp.down_proj.weight": rand(d, m),
        "norm.weight": norm_weight(),
        "lm_head.weight": rand(draft_vocab_size, d, scale=0.2),
        "d2t": used - torch.arange(draft_vocab_size),
        "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill_(0, used, True),
    }


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama's rotate_half RoPE on [B, heads, T, head_dim]."""
    half = x.shape[-1] // 2
    inv_freq = 1.0 / theta ** (torch.arange(0, half * 2, 2, dtype=torch.float64) / (half * 2))
    angles = (positions.double()[..., None] * inv_freq).float()  # [B, T, half]
    cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)[:, None]
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


@torch.no_grad()
def specforge_chains(
    checkpoint: dict[str, torch.Tensor], config: dict, embedding: torch.Tensor,
    features: torch.Tensor, next_tokens: torch.Tensor, num_steps: int,
) -> torch.Tensor:
    """Greedy chains [B, T, K] from every prefix, as SpecForge's EdsdDraftModel drafts them."""
    t, eps = checkpoint, config["rms_norm_eps"]
    heads, kv_heads, head_dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    b, n = next_tokens.shape
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    hidden = features @ t["fc.weight"].T
    tokens, keys, values, chain = next_tokens, [], [], []
    for step in range(num_steps):
        embeds = _rms(embedding[tokens], t["embnorm.weight"], eps)
        fused = (F.silu(hidden @ t["edfuse.gate_proj.weight"].T) * (embeds @ t["edfuse.up_proj.weight"].T)) @ t[
            "edfuse.down_proj.weight"
        ].T
        x = _rms(fused, t["midlayer.hidden_norm.weight"], eps)
        positions = torch.arange(n)[None].expand(b, n) + step
        q = _rotate(
            (x @ t["midlayer.self_attn.q_proj.weight"].T).view(b, n, heads, head_dim).transpose(1, 2),
            positions,
            config["rope_theta"],
        )
        k = _rotate(
            (x @ t["midlayer.self_attn.k_proj.weight"].T).view(b, n, kv_heads, head_dim).transpose(1, 2),
            positions,
            config["rope_theta"],
        )
        v = (x @ t["midlayer.self_attn.v_proj.weight"].T).view(b, n, kv_heads, head_dim).transpose(1, 2)
        keys.append(k.repeat_interleave(heads // kv_heads, 1))
        values.append(v.repeat_interleave(heads // kv_heads, 1))
        # SpecForge's cache_hidden: the first step's keys causally, then each later step's key
        # at the query's own index.
        scores = [(q @ keys[0].transpose(-1, -2)).masked_fill(~causal, float("-inf"))]
        scores += [(q * key).sum(-1, keepdim=True) for key in keys[1:]]
        weights = torch.softmax(torch.cat(scores, -1) / math.sqrt(head_dim), -1)
        attended = weights[..., :n] @ values[0] + sum(
            weights[..., n + i : n + i + 1] * val for i, val in enumerate(values[1:])
        )
        hidden = fused + attended.transpose(1, 2).reshape(b, n, -1) @ t["midlayer.self_attn.o_proj.weight"].T
        y = _rms(hidden, t["midlayer.post_attention_layernorm.weight"], eps)
        hidden = (
            hidden
            + (F.silu(y @ t["midlayer.mlp.gate_proj.weight"].T) * (y @ t["midlayer.mlp.up_proj.weight"].T))
            @ t["midlayer.mlp.down_proj.weight"].T
        )
        logits = _rms(hidden, t["norm.weight"], eps) @ t["lm_head.weight"].T
        draft = logits.argmax(-1)
        tokens = draft + t["d2t"][draft]
        chain.append(tokens)
    return torch.stack(chain, -1)
