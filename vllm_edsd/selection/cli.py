"""``edsd select``: run EDSelect on a calibration set and write the scores and the choice."""

from __future__ import annotations

import argparse

from vllm_edsd.command import add_stage_start, defaults, options_from, stage_run

from .stage import DEFAULT_MAX_LENGTH, SelectOptions
from .stage import run as select

EPILOG = """\
examples:
  edsd select /models/Llama-3.1-8B-Instruct --out layers.json --plot layers.png
  edsd select TARGET --data calib.jsonl --samples 64 --max-length 256 --out layers.json
--data takes ShareGPT-style JSON ([{"conversations": [{"from": "human", "value": ...}, ...]}])
or JSON lines with "conversations", "messages" or "text". Default: ShareGPT from PyPI.
"""


# The `edsd select` subcommand (vllm_edsd.command).
name = "select"
help = "EDSelect: score every target layer and pick the two aux layers"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_stage_start(parser, __doc__, EPILOG)
    parser.add_argument("--out", required=True, help="JSON file for the per-layer scores and the chosen ids")
    parser.add_argument("--data", help="calibration conversations (default: ShareGPT)")
    parser.add_argument("--samples", type=int, help="calibration samples (default %(default)s, the paper's)")
    parser.add_argument("--max-length", type=int,
                        help=f"tokens per sample (default {DEFAULT_MAX_LENGTH}, or the target's context where it "
                             "holds fewer)")
    parser.add_argument("--plot", help="PNG of the per-layer profiles (like the paper's Fig. 4)")
    parser.add_argument("--seed", type=int, help="calibration order and LiDAR's sampling (default %(default)s)")
    parser.add_argument("--device", help="where the target runs (default: cuda if present, else cpu)")
    parser.set_defaults(**defaults(SelectOptions))


def options(args: argparse.Namespace) -> SelectOptions:
    """The parsed arguments as the stage's options."""
    return options_from(SelectOptions, args)


run = stage_run(options, select)
