"""How an ``edsd`` subcommand is run, shared by ``vllm_edsd.cli`` and the stages.

A subcommand is one module with ``name``, ``help``, ``add_arguments(parser)`` and
``run(args) -> int``. User errors (``EDSDError``) are printed as one clear line with exit
status 2, never a traceback. A stage of the data flow (select, regenerate, features, train,
convert) is also a typed call: a frozen dataclass of its options, whose fields are its flags
(``options_from`` makes it from parsed arguments), and ``command_line`` writes the ``edsd``
command equivalent to one.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any, TypeVar

from vllm_edsd.errors import EDSDError

POSITIONAL = "positional"  # field metadata: the option is a positional argument of its command
T = TypeVar("T")


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM ends this process as Ctrl-C does, by a ``KeyboardInterrupt``, so that every
    ``finally`` on the way out runs and stops the servers and engines it started (Python's
    default SIGTERM ends the process at once and leaves them running). A second SIGTERM acts
    as before (by default it ends the process at once), as a second Ctrl-C forces a stop: where
    the first one was lost (vLLM building an offline engine, docs/known-issues.md) the process
    can still be stopped. Only the main thread can take signals: elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, previous)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def add_parser(subparsers, command: ModuleType) -> argparse.ArgumentParser:
    """The subcommand's parser under ``edsd``, its arguments added."""
    parser = subparsers.add_parser(command.name, help=command.help, description=command.help,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    command.add_arguments(parser)
    return parser


def reported(label: str, work: Callable[[], int | None]) -> int:
    """``work()``'s exit status, with user errors and Ctrl-C (or SIGTERM) as one line that
    starts with ``label`` and an exit status of their own (2, 130), never a traceback."""
    try:
        with sigterm_as_interrupt():
            return int(work() or 0)
    except EDSDError as exc:
        print(f"{label}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{label}: interrupted", file=sys.stderr)
        return 130


def invoke(command: ModuleType, args: argparse.Namespace) -> int:
    """``command.run(args)`` as ``edsd NAME``, reported."""
    return reported(f"edsd {command.name}", lambda: command.run(args))


def call(command: ModuleType, argv: list[str]) -> int:
    """``edsd NAME ARGV...`` for one subcommand module, without the others."""
    parser = argparse.ArgumentParser(prog=f"edsd {command.name}", description=command.help,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    command.add_arguments(parser)
    return invoke(command, parser.parse_args(argv))


def options_from(cls: type[T], args: argparse.Namespace, **given: Any) -> T:
    """The stage options ``cls`` (a dataclass whose fields are the subcommand's flags, by dest)
    from parsed ``args``; ``given`` holds the fields the subcommand converted itself."""
    return cls(**{f.name: given[f.name] if f.name in given else getattr(args, f.name)
                  for f in dataclasses.fields(cls) if f.init})


def add_stage_start(parser: argparse.ArgumentParser, doc: str | None, epilog: str) -> None:
    """What every stage subcommand's parser starts with: its module's docstring as the
    description, its examples as the epilog, and the target model as the first argument."""
    parser.description = doc
    parser.epilog = epilog
    parser.add_argument("target", help="target model directory (transformers format)")


def stage_run(options: Callable[[argparse.Namespace], T],
              stage: Callable[[T], Any]) -> Callable[[argparse.Namespace], int]:
    """A stage subcommand's ``run(args)``: its ``options(args)`` (the stage's dataclass, which
    ``command_line`` writes back as this command), then the stage."""

    def run(args: argparse.Namespace) -> int:
        stage(options(args))
        return 0

    return run


def defaults(cls: type) -> dict[str, Any]:
    """The defaults of the stage options ``cls``, for its subcommand's parser
    (``parser.set_defaults``): the dataclass is where a stage's defaults are written."""
    return {f.name: field_default(f) for f in dataclasses.fields(cls)
            if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING}


def command_line(name: str, options: Any, **shown: str) -> list[str]:
    """``edsd NAME ...``'s arguments that run ``options`` (a stage's dataclass), for a person to
    read or rerun: positional fields (metadata ``POSITIONAL``) first, then ``--flag value`` for
    each field that differs from its default (a true boolean: ``--flag`` alone). ``shown`` puts
    text in place of a field's value (one not known yet)."""
    positional, flags = [], []
    for f in dataclasses.fields(options):
        value = getattr(options, f.name)
        text = shown.get(f.name)
        if f.metadata.get(POSITIONAL):
            positional.append(text or argument_text(value))
        elif text is not None or value != field_default(f):
            flag = "--" + f.name.replace("_", "-")
            flags.extend([flag] if value is True and text is None else [flag, text or argument_text(value)])
    return [name, *positional, *flags]


def field_default(f: dataclasses.Field) -> Any:
    """The value a field takes when it is not given (None for a required one)."""
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None if f.default is dataclasses.MISSING else f.default


def argument_text(value: Any) -> str:
    """How a flag's value is written on a command line: ids comma-separated, a dict as JSON."""
    if isinstance(value, (tuple, list)):
        return ",".join(map(str, value))
    if isinstance(value, dict):
        return json.dumps(value)
    return str(value)
