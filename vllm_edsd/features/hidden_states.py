"""Target-model features with transformers, in vLLM's aux-hidden-state convention.

vLLM's aux id ``l`` is the residual stream at the *input* of decoder layer ``l`` (id 0 =
embeddings, id N = after the last layer, before the final norm). transformers'
``output_hidden_states`` agrees for ``l < N`` but returns the *normed* state at index N,
so features are captured with forward pre-hooks instead: one definition for every id.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vllm_edsd.checkpoint.target import TargetFingerprint
from vllm_edsd.errors import EDSDError


def decoder_of(model) -> torch.nn.Module:
    """The decoder stack (the module holding ``layers`` and ``norm``)."""
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "norm"):
        raise EDSDError(f"{type(model).__name__}: unsupported target (no model.layers / model.norm)")
    return inner


def fingerprint(model) -> TargetFingerprint:
    cfg = model.config
    return TargetFingerprint.from_hf_config(getattr(cfg, "text_config", None) or cfg)


@dataclass
class TargetOutputs:
    """Per-token target outputs for a batch [B, T]."""

    aux: dict[int, torch.Tensor]  # vLLM layer id -> [B, T, d_t]
    logits: torch.Tensor | None  # [B, T, V]; None when the forward stopped at the last aux layer
    final_hidden: torch.Tensor | None  # [B, T, d_t]: the lm_head's input, logits = lm_head(final_hidden)

    def features(self, layer_ids: tuple[int, ...]) -> torch.Tensor:
        """Concatenation in ascending id order, as vLLM's runner concatenates them."""
        return torch.cat([self.aux[i] for i in sorted(layer_ids)], -1)


class _Captured(Exception):
    """Raised by a capture hook to end a forward once everything asked for is captured."""


@torch.no_grad()
def run_target(
    model, input_ids: torch.Tensor, layer_ids: tuple[int, ...], attention_mask: torch.Tensor | None = None,
    *, outputs: bool = True,
) -> TargetOutputs:
    """Forward the target once, capturing the residual stream at each requested id.
    ``outputs=False`` stops the forward at the highest requested id: no later layers, no logits."""
    decoder = decoder_of(model)
    n = len(decoder.layers)
    bad = [i for i in layer_ids if not 0 <= i <= n]
    if bad:
        raise EDSDError(f"layer ids {bad} do not exist in a target with {n} layers (valid: 0..{n})")
    captured: dict[int, torch.Tensor] = {}
    hooks = []
    last = max(layer_ids) if layer_ids else None

    def capture(layer_id: int):
        def hook(_module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            captured[layer_id] = hidden.detach()
            if not outputs and layer_id == last:
                raise _Captured

        return hook

    for layer_id in set(layer_ids):
        module = decoder.norm if layer_id == n else decoder.layers[layer_id]
        hooks.append(module.register_forward_pre_hook(capture(layer_id), with_kwargs=True))
    if outputs:
        hooks.append(model.get_output_embeddings().register_forward_pre_hook(capture(-1), with_kwargs=True))
    try:
        out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    except _Captured:
        out = None
    finally:
        for h in hooks:
            h.remove()
    if out is None:
        return TargetOutputs(aux=captured, logits=None, final_hidden=None)
    final_hidden = captured.pop(-1)
    return TargetOutputs(aux=captured, logits=out.logits.float(), final_hidden=final_hidden)


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Shannon entropy (nats) of the target's predictive distribution, per position."""
    logp = torch.log_softmax(logits.float(), -1)
    return -(logp.exp() * logp).sum(-1)


@dataclass
class SampleFeatures:
    """What training keeps of one sample's target forward (``shards.py`` stores it):
    the chosen layers' features, the lm_head input, and the target's argmax and entropy, which
    would otherwise cost a full-vocabulary product in every training step."""

    aux: torch.Tensor  # [n, len(layers) * d_t], ascending layer ids
    final: torch.Tensor  # [n, d_t]
    argmax: torch.Tensor  # [n]
    entropy: torch.Tensor  # [n], nats over the full vocabulary


class TransformersFeatures:
    """Target features from a transformers model, ``batch_size`` samples per padded forward
    (the fallback where vLLM cannot extract them, ``vllm_extraction.py``)."""

    backend = "transformers"

    def __init__(self, model, layer_ids: tuple[int, ...], *, batch_size: int = 4, device: str = "cpu"):
        self.model, self.layer_ids, self.batch_size, self.device = model, layer_ids, batch_size, device

    def __enter__(self) -> TransformersFeatures:
        return self

    def __exit__(self, *exc) -> None:
        return None

    def features(self, samples: Sequence[list[int]]) -> list[SampleFeatures]:
        """One ``SampleFeatures`` per token list, in order."""
        found = []
        for b in range(0, len(samples), self.batch_size):
            batch = samples[b : b + self.batch_size]
            width = max(len(tokens) for tokens in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            attention = torch.zeros(len(batch), width, dtype=torch.long)
            for row, tokens in enumerate(batch):
                ids[row, : len(tokens)] = torch.tensor(tokens)
                attention[row, : len(tokens)] = 1
            out = run_target(self.model, ids.to(self.device), self.layer_ids, attention.to(self.device))
            aux, argmax, entropy = out.features(self.layer_ids), out.logits.argmax(-1), token_entropy(out.logits)
            found += [SampleFeatures(aux[row, :n], out.final_hidden[row, :n], argmax[row, :n], entropy[row, :n])
                      for row, n in enumerate(len(tokens) for tokens in batch)]
        return found
