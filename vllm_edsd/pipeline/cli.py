"""``edsd pipeline CONFIG``: one TOML file says how a drafter is made (the target, the data, the
layers, the training budget, the output), and the stages not yet done run, in the order of the
data flow (docs/architecture.md):

1. ``data``          the conversations: a JSON(L) file, or first user turns of ShareGPT (seeded);
2. ``regenerate``    the target answers them through vLLM (greedy), so the drafters learn the
   target's own distribution (optional);
3. ``select``        EDSelect's two layers (``edsd select``), unless ``[layers] edsd`` names them;
4. ``features``      the target's features for every method's layers, extracted once
   (``edsd features``: by vLLM where the installed vLLM can, docs/scale.md);
5. ``train-METHOD``  ``edsd train`` per method: same data, order, seed and budget;
6. ``convert``       the EDSD drafter to vLLM's layout (``edsd convert``), checked against the target.

A stage is skipped when its output is finished (a data file written, a complete checkpoint);
an interrupted one goes on where it stopped (training from its last epoch): rerun the same
command. Relative paths in the file are relative to the file.
"""

from __future__ import annotations

import argparse

from vllm_edsd.errors import EDSDError
from vllm_edsd.methods import METHODS

from .config import EXAMPLE, load_config
from .stages import run_pipeline

# The `edsd pipeline` subcommand (vllm_edsd.command).
name = "pipeline"
help = "make a drafter from one TOML description: data, regeneration, layers, features, training, conversion"
# `--stop-after` takes a stage, or "train": after every method's training
STAGE_NAMES = ("data", "regenerate", "select", "features", *(f"train-{m}" for m in METHODS), "train", "convert")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__
    parser.epilog = ("examples:\n  edsd pipeline --example > smollm2.toml   # a commented config to start from\n"
                     "  edsd pipeline smollm2.toml --dry-run      # what each stage would run, what is done\n"
                     "  edsd pipeline smollm2.toml                # run (rerun to resume)\n"
                     "  edsd pipeline smollm2.toml --stop-after select\n\nan example config:\n\n" + EXAMPLE)
    parser.add_argument("config", nargs="?", help="the TOML file")
    parser.add_argument("--stop-after", choices=STAGE_NAMES, help="stop after this stage ('train': after all)")
    parser.add_argument("--dry-run", action="store_true", help="print what each stage would run and what is done")
    parser.add_argument("--example", action="store_true", help="print an example config and exit")


def run(args: argparse.Namespace) -> int:
    if args.example:
        print(EXAMPLE, end="")
        return 0
    if not args.config:
        raise EDSDError("name a config file (edsd pipeline --example prints one)")
    run_pipeline(load_config(args.config), args.stop_after, args.dry_run)
    return 0
