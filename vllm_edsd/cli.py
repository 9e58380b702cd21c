"""The ``edsd`` command. Each subcommand lives in its own module, imported only when used,
so ``edsd --help`` is instant and one broken optional dependency cannot break the rest.

A subcommand module provides ``add_arguments(parser)`` and ``run(args) -> int``.
User errors (``EDSDError``) are printed as one clear line with exit status 2, never a
traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from vllm_edsd.errors import EDSDError

SUBCOMMANDS = {
    "convert": (
        "weights_convert.cli",
        "convert an EDSD drafter (this project's training layout or SpecForge's) to the layout vLLM serves",
    ),
    "select": ("vllm_edsd.selection_cli", "EDSelect: score every target layer and pick the two aux layers"),
    "train": ("vllm_edsd.training.cli", "EDTrain: train an EDSD drafter (or an EAGLE-3 baseline) for a target"),
    "demo": (
        "vllm_edsd.demo",
        "serve the embedded demo target with its EDSD and EAGLE-3 drafters; show tau and speed-up",
    ),
    "build-demo": (
        "vllm_edsd.demo.build",
        "train the embedded demo drafters (EDSD + EAGLE-3) for the demo target from PyPI data",
    ),
}

EPILOG = """\
typical flow for a new target:
  edsd select TARGET --out layers.json          # pick the two aux layers
  edsd train TARGET --out runs/edsd --layers-from layers.json
  edsd convert runs/edsd/final drafter          # training layout -> vLLM layout
  vllm serve TARGET --speculative-config '{"method":"edsd","model":"drafter","num_speculative_tokens":4}'
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="edsd",
        description="Serve and train EDSD speculative-decoding drafters in vLLM.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = sys.argv[1] if len(sys.argv) > 1 else None
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(
            name, help=help_text, description=help_text, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        if name == chosen:  # only the chosen subcommand's module is imported
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    if argv is not None:
        sys.argv = ["edsd", *argv]
    parser = build_parser()
    args = parser.parse_args()
    if not args.command:
        parser.print_help()
        return 0
    module = importlib.import_module(SUBCOMMANDS[args.command][0])
    try:
        return int(module.run(args) or 0)
    except EDSDError as exc:
        print(f"edsd {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"edsd {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
