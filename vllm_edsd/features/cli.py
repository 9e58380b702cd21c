"""``edsd features``: the target's features for the training samples, extracted once (by vLLM
where it can) into the shard cache that ``edsd train`` then reads, with a manifest of the
run's shards (docs/scale.md, "Feature shards").

The samples are decided by the same options as ``edsd train``'s, so a following
``edsd train TARGET --cache CACHE --feature-layers IDS`` with those options finds every shard
and runs no target forward. Resumable: shards already written are kept.
"""

from __future__ import annotations

import argparse

from vllm_edsd.command import add_stage_start, defaults, options_from, stage_run

from .samples import add_data_arguments, layer_ids
from .stage import FeaturesOptions
from .stage import run as extract

EPILOG = """\
examples:
  edsd features TARGET --cache runs/cache --feature-layers 2,3,15,27 --data answers.jsonl
  edsd train TARGET --out runs/edsd --cache runs/cache --feature-layers 2,3,15,27 --data answers.jsonl --layers 3,15
"""

# The `edsd features` subcommand (vllm_edsd.command).
name = "features"
help = "extract the target's features for training (vLLM's extraction where available), resumable"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_stage_start(parser, __doc__, EPILOG)
    parser.add_argument("--cache", required=True,
                        help="the cache `edsd train --cache` reads (features go in CACHE/features)")
    parser.add_argument("--feature-layers", required=True,
                        help="layer ids (vLLM convention) whose features are stored: those of every drafter to train")
    add_data_arguments(parser)
    parser.set_defaults(**defaults(FeaturesOptions))


def options(args: argparse.Namespace) -> FeaturesOptions:
    """The parsed arguments as the stage's options."""
    return options_from(FeaturesOptions, args, feature_layers=layer_ids(args.feature_layers, "--feature-layers"))


run = stage_run(options, extract)
