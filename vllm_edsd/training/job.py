"""What ``edsd train`` runs, made from its options (``TrainOptions``): the samples, the target's
features, the draft vocabulary, the initial drafter and the recipe, the same on every rank."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from vllm_edsd.checkpoint.target import TargetFingerprint, decoder_layers, read_config_json, text_config
from vllm_edsd.errors import EDSDError
from vllm_edsd.features.samples import (
    cut_line,
    feature_shards,
    resolve_feature_layers,
    resolve_max_length,
    target_dtype,
    training_samples,
)
from vllm_edsd.features.shards import aux_columns
from vllm_edsd.launch.engine import cpu_computes_natively
from vllm_edsd.launch.transformers_target import load_target

from .distributed import SINGLE, World
from .draft_vocab import answer_token_counts, build_vocab_mapping
from .drafter import build_model, draft_switches, resolve_layers
from .options import TrainOptions
from .recipe import Recipe


def check_numbers(options: TrainOptions, vocab: int) -> None:
    """Refuse out-of-range numbers before any work (a 0 must not silently mean "the default")."""
    if options.draft_vocab_size is not None and not 0 < options.draft_vocab_size <= vocab:
        raise EDSDError(
            f"--draft-vocab-size must be in 1..{vocab} (the target's vocabulary), got {options.draft_vocab_size}"
        )
    for flag in ("epochs", "ttt_steps", "batch_size", "fuse_intermediate_size", "intermediate_size"):
        value = getattr(options, flag)
        if value is not None and value < 1:
            raise EDSDError(f"--{flag.replace('_', '-')} must be a positive integer, got {value}")
    if options.save_every < 0:
        raise EDSDError(f"--save-every is a number of batches: 0 (after each epoch only) or more, "
                        f"got {options.save_every}")
    if not options.lr > 0:
        raise EDSDError(f"--lr must be positive, got {options.lr}")
    if not 0 <= options.warmup < 1:
        raise EDSDError(f"--warmup is a fraction of the optimizer steps, from 0 up to (not including) 1, "
                        f"got {options.warmup}")
    if not options.weight_decay >= 0:
        raise EDSDError(f"--weight-decay must be 0 or more, got {options.weight_decay}")
    if not 0 <= options.feature_noise < 10:
        raise EDSDError(f"--feature-noise is relative to the features' RMS: 0 (none) up to 10, "
                        f"got {options.feature_noise}")


@dataclass
class Job:
    """Everything ``train`` needs, made from the arguments."""

    model: torch.nn.Module
    shards: list[Path]
    draft_head: torch.Tensor
    recipe: Recipe
    columns: torch.Tensor | None


def prepare(options: TrainOptions, world: World = SINGLE, device: str | None = None) -> Job:
    """The samples, target features, draft vocabulary and initial drafter on ``device``
    (default ``--device``): the same on every rank (tokenisation and vocabulary are
    deterministic)."""
    options = options.on_device()
    out, device = Path(options.out), device or options.device
    cfg_raw = read_config_json(options.target)
    source = f"{options.target}/config.json"
    target = TargetFingerprint.from_hf_config(text_config(cfg_raw, source), source)
    target_layers = decoder_layers(options.target)
    layers = resolve_layers(options, target_layers)
    feature_layers = resolve_feature_layers(options.feature_layers, layers, target_layers)
    check_numbers(options, target.vocab_size)
    draft_switches(options)  # refused here, before the samples and features are made
    options, length_set_by = resolve_max_length(options)
    from transformers.utils import logging

    if not world.main:  # progress bars on rank 0 only
        logging.disable_progress_bar()
    cache = Path(options.cache) if options.cache else out / "cache"
    samples, read, skipped, cut = training_samples(options, cache, world)
    counts = answer_token_counts(samples)
    vocab = target.vocab_size
    d2t, t2d = build_vocab_mapping(counts, vocab, options.draft_vocab_size or min(32000, vocab))
    # vLLM's extraction runs (and frees its memory) before transformers loads the target
    shards = feature_shards(options, samples, feature_layers, cache, world, device)
    target_model = load_target(options.target, dtype=getattr(torch, target_dtype(options, device)), device=device)
    model = build_model(options, target_model, cfg_raw, layers, d2t, t2d).to(device)
    # Only the draft vocabulary's rows (in draft-id order: d2t keeps target ids ascending) are read.
    draft_head = target_model.get_output_embeddings().weight.detach()[torch.nonzero(t2d).flatten()].float()
    recipe = Recipe.from_options(options)
    if world.main:
        if skipped:
            print(f"skipped {skipped} of {read} conversations: the chat template does not render "
                  "their answers after their own prompts")
        if cut:
            print(cut_line(cut, len(samples), options.max_length, length_set_by))
        print(f"{options.method}: {len(samples)} samples, layers {list(layers)}, draft vocab {len(d2t)}, "
              f"{sum(p.numel() for p in model.parameters() if p.requires_grad):,} trainable parameters"
              + (f", {world.size} data-parallel processes ({world.data_parallel})" if world.size > 1 else ""))
        if recipe.autocast and torch.device(device).type == "cpu" and not cpu_computes_natively(recipe.autocast):
            print(f"warning: --autocast {recipe.autocast} on a CPU that emulates it (no native {recipe.autocast} "
                  "instructions in /proc/cpuinfo): training runs slower than in float32")
    columns = None if feature_layers == layers else aux_columns(feature_layers, layers, target.hidden_size)
    return Job(model, shards, draft_head, recipe, columns)
