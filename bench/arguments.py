"""Comma-separated number lists on the bench's command lines (``--k 1,2,4``, ``--sizes``...),
parsed alike in every script so that a bad value is the same one line everywhere."""

from __future__ import annotations

from vllm_edsd.errors import EDSDError


def numbers(flag: str, text: str, kind: type, least: float, above: bool = False) -> list:
    """A comma-separated list of ints or floats, each at least ``least`` (above it with
    ``above``), or one line naming the flag and the value at fault."""
    values = []
    for item in text.split(","):
        try:
            value = kind(item)
        except ValueError:
            value = None
        if value is None or value != value or value < least or (above and value == least):  # NaN fails too
            bound = f"above {least}" if above else f"at least {least}"
            raise EDSDError(f"{flag} takes comma-separated {kind.__name__}s, each {bound}; got {item!r} in {text!r}")
        values.append(value)
    return values
