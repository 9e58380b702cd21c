"""How an ``edsd`` subcommand is run, shared by ``vllm_edsd.cli`` and the commands that run
others (``edsd build-demo`` runs ``select``, ``train`` and ``convert``).

A subcommand is one module with ``name``, ``help``, ``add_arguments(parser)`` and
``run(args) -> int``. User errors (``EDSDError``) are printed as one clear line with exit
status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from types import ModuleType

from vllm_edsd.errors import EDSDError


def add_parser(subparsers, command: ModuleType) -> argparse.ArgumentParser:
    """The subcommand's parser under ``edsd``, its arguments added."""
    parser = subparsers.add_parser(command.name, help=command.help, description=command.help,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    command.add_arguments(parser)
    return parser


def invoke(command: ModuleType, args: argparse.Namespace) -> int:
    """``command.run(args)``, with user errors and Ctrl-C as one line and an exit status."""
    try:
        return int(command.run(args) or 0)
    except EDSDError as exc:
        print(f"edsd {command.name}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"edsd {command.name}: interrupted", file=sys.stderr)
        return 130


def call(command: ModuleType, argv: list[str]) -> int:
    """``edsd NAME ARGV...`` for one subcommand module, without the others."""
    parser = argparse.ArgumentParser(prog=f"edsd {command.name}", description=command.help,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    command.add_arguments(parser)
    return invoke(command, parser.parse_args(argv))
