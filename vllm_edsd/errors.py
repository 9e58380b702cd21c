"""The one exception type users see: a message that names the file, field or tensor at fault;
and the integer checks every room makes on what users give (config files, speculative configs)."""

from typing import Any


class EDSDError(ValueError):
    """A user-facing error: the CLI prints it as one line (exit status 2), never a traceback."""


def is_int(value: Any) -> bool:
    """An integer and not a boolean: JSON's and TOML's ``true`` is Python's ``1``, never a count."""
    return isinstance(value, int) and not isinstance(value, bool)


def positive_int(value: Any, what: str) -> int:
    """``value`` where it is an integer of 1 or more, else one EDSDError line naming ``what``
    (a field, a key or a flag, with the file it is in)."""
    if not is_int(value) or value < 1:
        raise EDSDError(f"{what} must be a positive integer, got {value!r:.80}")
    return value


def first_line(exc: BaseException, limit: int = 300) -> str:
    """An exception's message as one line, for the user error it caused: its first non-empty
    line, cut at ``limit`` characters, or its type's name where it has no message."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0][:limit] if lines else type(exc).__name__
