"""``edsd features``: the target's features for the training samples, extracted once (by vLLM
where it can) into the shard cache that ``edsd train`` then reads, with a manifest of the
run's shards (docs/scale.md, "Feature shards").

The samples are decided by the same options as ``edsd train``'s, so a following
``edsd train TARGET --cache CACHE --feature-layers IDS`` with those options finds every shard
and runs no target forward. Resumable: shards already written are kept.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from vllm_edsd.checkpoint.target import decoder_layers

from .samples import (
    add_data_arguments,
    cut_line,
    feature_shards,
    resolve_feature_layers,
    resolve_max_length,
    training_samples,
)
from .shards import manifest_path

EPILOG = """\
examples:
  edsd features TARGET --cache runs/cache --feature-layers 2,3,15,27 --data answers.jsonl
  edsd train TARGET --out runs/edsd --cache runs/cache --feature-layers 2,3,15,27 --data answers.jsonl --layers 3,15
"""

# The `edsd features` subcommand (vllm_edsd.command).
name = "features"
help = "extract the target's features for training (vLLM's extraction where available), resumable"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__
    parser.epilog = EPILOG
    parser.add_argument("target", help="target model directory (transformers format)")
    parser.add_argument("--cache", required=True,
                        help="the cache `edsd train --cache` reads (features go in CACHE/features)")
    parser.add_argument("--feature-layers", required=True,
                        help="layer ids (vLLM convention) whose features are stored: those of every drafter to train")
    add_data_arguments(parser)


def run(args: argparse.Namespace) -> int:
    layers = resolve_feature_layers(args.feature_layers, (), decoder_layers(args.target))
    cache = Path(args.cache)
    length_set_by = resolve_max_length(args)
    samples, read, skipped, cut = training_samples(args, cache)
    if cut:
        print(cut_line(cut, len(samples), args.max_length, length_set_by))
    shards = feature_shards(args, samples, layers, cache)
    positions = sum(len(ids) for ids, _ in samples)
    stored = sum(path.stat().st_size for path in shards)
    print(f"features: {len(samples)} samples of {read} conversations ({skipped} not renderable), {positions:,} "
          f"positions, layers {list(layers)}: {len(shards)} shards, {stored / 2**20:,.1f} MiB in {cache / 'features'}")
    print(f"manifest: {manifest_path(cache / 'features', shards)}")
    return 0
