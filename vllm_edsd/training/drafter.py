"""The drafter to train: its aux layers (``--layers``, ``--layers-from``, EAGLE-3's defaults), its
draft-layer switches (``--feature-norm``, ``--norm-before-fc``, ...: each method's own) and its
initial weights, taken from the target where shapes allow (the same for both methods)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from vllm_edsd.errors import EDSDError
from vllm_edsd.features.hidden_states import decoder_of
from vllm_edsd.methods import METHODS, method
from vllm_edsd.methods.edsd.config import EDSDConfig

from .options import TrainOptions


def resolve_layers(options: TrainOptions, num_layers: int) -> tuple[int, ...]:
    """The drafter's aux layers: ``--layers-from`` (EDSelect's), ``--layers`` or the method's
    default, checked against the method and the target's layer count."""
    drafting = method(options.method)
    want = drafting.aux_layers
    if options.layers and options.layers_from:
        raise EDSDError("--layers and --layers-from both name the aux layers: give one")
    if options.layers_from:
        if drafting.default_layers is not None:
            raise EDSDError(f"--layers-from is EDSelect's choice for EDSD; pass --layers for {options.method}")
        try:
            ids = json.loads(Path(options.layers_from).read_text())["aux_layer_ids"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise EDSDError(f"{options.layers_from}: not an `edsd select` result ({exc})") from None
    elif options.layers:
        ids = list(options.layers)
    elif drafting.default_layers is not None:
        ids = drafting.default_layers(num_layers)
    else:
        raise EDSDError(f"{drafting.label} needs its {want} aux layers: --layers-from (from `edsd select`) "
                        "or --layers a,b")
    if len(ids) != want or len(set(ids)) != want:
        raise EDSDError(f"{options.method} needs {want} distinct aux layer ids, got {ids}")
    if not all(0 <= i <= num_layers for i in ids):
        raise EDSDError(f"aux layer ids {ids} must lie in 0..{num_layers} for this target")
    return tuple(sorted(ids))


def as_flag(name: str) -> str:
    """A switch's ``edsd train`` flag: ``norm_before_fc`` -> ``--norm-before-fc``."""
    return f"--{name.replace('_', '-')}"


def draft_switches(options: TrainOptions) -> dict[str, bool]:
    """The method's draft-layer switches, name -> on. Another method's switch turned on, or a
    combination the method refuses, is one line, before any work."""
    drafting = method(options.method)
    for other in METHODS.values():
        stray = [as_flag(name) for name in other.switches if getattr(options, name) and name not in drafting.switches]
        if stray:
            raise EDSDError(f"{', '.join(stray)}: a switch of {other.label}'s draft layer, not {options.method}'s")
    switches = {name: getattr(options, name) for name in drafting.switches}
    if drafting.refuse_switches is not None:
        drafting.refuse_switches(switches, f"--method {options.method}", as_flag)
    return switches


def draft_config(options: TrainOptions, cfg_raw: dict, layers: tuple[int, ...], draft_vocab: int) -> EDSDConfig:
    """The sizes and norms of the drafter ``options`` train for a target of config ``cfg_raw``
    (both methods build from it; the widths left unset are the target's)."""
    return EDSDConfig.for_target(cfg_raw, layers[:2], draft_vocab_size=draft_vocab,
                                 fuse_intermediate_size=options.fuse_intermediate_size,
                                 intermediate_size=options.intermediate_size, token_norm=options.token_norm,
                                 source=f"{options.target}/config.json")


def build_model(options: TrainOptions, target_model, cfg_raw: dict, layers: tuple[int, ...], d2t, t2d):
    """The drafter, initialised from the target where shapes allow (same for both methods)."""
    draft_vocab = len(d2t)
    cfg = draft_config(options, cfg_raw, layers, draft_vocab)
    torch.manual_seed(options.seed)
    model = method(options.method).model.build(cfg, layers, **draft_switches(options))
    with torch.no_grad():
        model.embed_tokens.weight.copy_(decoder_of(target_model).embed_tokens.weight)
        head = target_model.get_output_embeddings().weight
        used = torch.arange(draft_vocab) + d2t
        if head.shape[1] == cfg.hidden_size:
            model.lm_head.weight.copy_(head[used])
        model.d2t.copy_(d2t)
        model.t2d.copy_(t2d)
    return model
