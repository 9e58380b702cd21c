"""The drafter to train: its aux layers (``--layers``, ``--layers-from``, EAGLE-3's defaults) and
its initial weights, taken from the target where shapes allow (the same for both methods)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from vllm_edsd.errors import EDSDError
from vllm_edsd.features.hidden_states import decoder_of
from vllm_edsd.methods import method
from vllm_edsd.methods.edsd.config import EDSDConfig


def resolve_layers(args: argparse.Namespace, num_layers: int) -> tuple[int, ...]:
    drafting = method(args.method)
    want = drafting.aux_layers
    if args.layers_from:
        if drafting.default_layers is not None:
            raise EDSDError(f"--layers-from is EDSelect's choice for EDSD; pass --layers for {args.method}")
        try:
            ids = json.loads(Path(args.layers_from).read_text())["aux_layer_ids"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise EDSDError(f"{args.layers_from}: not an `edsd select` result ({exc})") from None
    elif args.layers:
        try:
            ids = [int(x) for x in args.layers.split(",")]
        except ValueError:
            raise EDSDError(f"--layers {args.layers!r}: expected comma-separated integers") from None
    elif drafting.default_layers is not None:
        ids = drafting.default_layers(num_layers)
    else:
        raise EDSDError(f"{drafting.label} needs its {want} aux layers: --layers-from (from `edsd select`) "
                        "or --layers a,b")
    if len(ids) != want or len(set(ids)) != want:
        raise EDSDError(f"{args.method} needs {want} distinct aux layer ids, got {ids}")
    if not all(0 <= i <= num_layers for i in ids):
        raise EDSDError(f"aux layer ids {ids} must lie in 0..{num_layers} for this target")
    return tuple(sorted(ids))


def build_model(args, target_model, cfg_raw: dict, layers: tuple[int, ...], d2t, t2d):
    """The drafter, initialised from the target where shapes allow (same for both methods)."""
    draft_vocab = len(d2t)
    cfg = EDSDConfig.for_target(cfg_raw, layers[:2], draft_vocab_size=draft_vocab,
                                fuse_intermediate_size=args.fuse_intermediate_size,
                                intermediate_size=args.intermediate_size, token_norm=args.token_norm,
                                source=f"{args.target}/config.json")
    torch.manual_seed(args.seed)
    model = method(args.method).model.build(cfg, layers)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(decoder_of(target_model).embed_tokens.weight)
        head = target_model.get_output_embeddings().weight
        used = torch.arange(draft_vocab) + d2t
        if head.shape[1] == cfg.hidden_size:
            model.lm_head.weight.copy_(head[used])
        model.d2t.copy_(d2t)
        model.t2d.copy_(t2d)
    return model
