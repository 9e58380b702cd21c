"""The ``edsd`` command.

Each subcommand is one module with ``name``, ``help``, ``add_arguments(parser)`` and
``run(args) -> int`` (``vllm_edsd.command``), registered in ``COMMANDS`` below. Only the
chosen subcommand's module is imported (``edsd --help`` imports them all to list them), so one
broken optional dependency cannot break the rest. User errors (``EDSDError``) are printed as
one clear line with exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback
from typing import NoReturn

from vllm_edsd.command import add_parser, invoke

# name -> the module that implements it; the module's own `name` and `help` are what users see.
COMMANDS = {
    "convert": "vllm_edsd.conversion.cli",
    "select": "vllm_edsd.selection.cli",
    "regenerate": "vllm_edsd.regeneration.cli",
    "features": "vllm_edsd.features.cli",
    "train": "vllm_edsd.training.cli",
    "pipeline": "vllm_edsd.pipeline.cli",
    "demo": "vllm_edsd.demo.cli",
    "build-demo": "vllm_edsd.demo.build",
}

EPILOG = """\
typical flow for a new target:
  edsd select TARGET --out layers.json          # pick the two aux layers
  edsd train TARGET --out runs/edsd --layers-from layers.json
  edsd convert runs/edsd/final drafter          # training layout -> vLLM layout
  vllm serve TARGET --speculative-config '{"method":"edsd","model":"drafter","num_speculative_tokens":4}'
or the whole flow from one TOML file (resumable):
  edsd pipeline --example > drafter.toml && edsd pipeline drafter.toml
at scale (docs/scale.md): edsd regenerate and edsd features run the target in vLLM (tensor parallel),
  torchrun --nproc-per-node N -m vllm_edsd train ... trains data-parallel
"""


def build_parser(chosen: str | None = None) -> argparse.ArgumentParser:
    """The parser of ``edsd``; with ``chosen``, only that subcommand's module is imported."""
    parser = argparse.ArgumentParser(
        prog="edsd",
        description="Serve and train EDSD speculative-decoding drafters in vLLM.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module in COMMANDS.items():
        if chosen is None or name == chosen:
            add_parser(sub, importlib.import_module(module))
        else:
            sub.add_parser(name)  # a placeholder: only the chosen one is parsed
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    chosen = argv[0] if argv and argv[0] in COMMANDS else None
    parser = build_parser(chosen)
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 0
    return invoke(importlib.import_module(COMMANDS[args.command]), args)


def console() -> NoReturn:
    """The ``edsd`` executable and ``python -m vllm_edsd``: ``main`` with its status as the exit
    status. A data-parallel rank (torchrun sets ``WORLD_SIZE``) leaves with ``os._exit`` once its
    output is flushed, skipping the interpreter's teardown: torch's gloo worker threads outlive
    ``destroy_process_group`` (FSDP and ``torch.distributed.nn`` keep the group alive), and one
    still releasing the last collective's tensors when the teardown starts cannot take the GIL,
    which aborts the rank after a finished run (SIGABRT, docs/scale.md)."""
    if os.environ.get("WORLD_SIZE", "1") in ("", "0", "1"):
        sys.exit(main())
    try:
        status = main()
    except SystemExit as exc:  # argparse's usage errors and --help
        status = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    except BaseException:  # a crash: its traceback, then the same quick exit
        traceback.print_exc()
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)

if __name__ == "__main__":
    console()
