"""Config schemas declared as dataclasses: each field's place in config.json, its value where
the file leaves it out, its check and a one-line doc sit in the field's metadata (``entry``),
and ``read_fields`` walks a schema's fields in their order, so a file's first problem in that
order is the one reported, naming the file and the field. The drafters' configs
(``vllm_edsd.methods``) are declared this way; the size and constant checks every reader of a
config.json makes are here too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vllm_edsd.errors import EDSDError, is_int, positive_int

# No size, count or constant of a drafter reaches 2**31: a larger one is a typo or an attack,
# and would overflow an int32 index or an allocation further on.
MAX_FIELD = 2**31


def check_size(value: Any, what: str) -> int:
    """A size or count of a drafter: a positive integer below 2**31."""
    return _below_max_field(positive_int(value, what), what)


def check_constant(value: Any, what: str) -> int | float:
    """A positive number below 2**31 (an epsilon, a RoPE base); NaN and infinity are refused."""
    if not (is_int(value) or isinstance(value, float)) or not value > 0:  # NaN too
        raise EDSDError(f"{what} must be a positive number, got {value!r:.40}")
    return _below_max_field(value, what)


def _below_max_field(value: int | float, what: str) -> int | float:
    """No size, count or constant of a drafter reaches 2**31 (MAX_FIELD)."""
    if not value < MAX_FIELD:  # infinity, and sizes that overflow further on
        raise EDSDError(f"{what} must be below 2**31, got {value!r:.40}")
    return value


class _Required:
    """The ``absent`` of a field the file must have."""

    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()
ENTRY = "config_entry"  # the metadata key of a field's ``Entry``


@dataclass
class Reading:
    """One config.json being read: what the checks and readers of its fields see."""

    raw: dict  # the whole file
    source: str  # how errors name the file
    block: str | None  # the schema's own block (``edsd_config``); its fields' paths start there
    options: dict  # what the caller says beyond the file (the converter's ``--layer-id-convention``)
    got: dict = field(default_factory=dict)  # the fields read so far, by name

    def own_block(self) -> dict:
        """The schema's own block ({} where the schema has none or the file lacks it)."""
        block = self.raw.get(self.block) if self.block else None
        return block if isinstance(block, dict) else {}


@dataclass(frozen=True)
class Entry:
    """How one field is read from config.json."""

    doc: str  # what the field is, in one line
    path: tuple[str | int, ...] = ()  # its keys and list indices in the file; () = its name
    block: bool = False  # under the schema's own block rather than at the top level
    # Its value where the file leaves it out: a value, or a callable of the Reading; REQUIRED:
    # the file must have it.
    absent: Any = REQUIRED
    null_absent: bool = True  # a null counts as left out (for a field that may be left out)
    check: Callable[[Any, str, Reading], Any] | None = None  # (value, what, reading) -> the field's value
    read: Callable[[Reading], Any] | None = None  # the value read otherwise: several keys, the whole file


def entry(doc: str, *, default: Any = dataclasses.MISSING, default_factory: Any = dataclasses.MISSING,
          **how: Any) -> Any:
    """A dataclass field with its ``Entry`` (``how``: the Entry's other attributes); a field
    the file leaves out takes its ``default`` unless ``absent`` says otherwise."""
    if default is not dataclasses.MISSING:
        how.setdefault("absent", default)
    return field(default=default, default_factory=default_factory, metadata={ENTRY: Entry(doc, **how)})


def dotted(path: tuple[str | int, ...]) -> str:
    """A path as errors name it: ``speculators_config.proposal_methods[0].speculative_tokens``."""
    text = ""
    for step in path:
        text += f"[{step}]" if isinstance(step, int) else f".{step}" if text else step
    return text


def missing_field(path: tuple[str | int, ...], reading: Reading, exc: Exception) -> None:
    """The error of a required field the file lacks."""
    raise EDSDError(f"{reading.source}: missing field '{dotted(path)}'") from None


def read_fields(schema: type, raw: dict, source: str, *, block: str | None = None,
                missing: Callable[[tuple, Reading, Exception], None] = missing_field, **options: Any) -> dict:
    """The fields of ``schema`` that have an entry, read from ``raw`` in the order they are
    declared and checked as each entry says; ``missing`` raises for a required field the
    file lacks."""
    reading = Reading(raw, source, block, options)
    for spec in dataclasses.fields(schema):
        how = spec.metadata.get(ENTRY)
        if how is not None:
            reading.got[spec.name] = _field_value(spec.name, how, reading, missing)
    return reading.got


def _field_value(name: str, how: Entry, reading: Reading, missing: Callable) -> Any:
    """One field's value: read, or looked up along its path (its ``absent`` where the file
    leaves it out), then checked."""
    path = (*((reading.block,) if how.block and reading.block else ()), *(how.path or (name,)))
    if how.read is not None:
        value = how.read(reading)
    else:
        try:
            value = _lookup(reading.raw, path) if reading.block or not how.block else None  # no block: left out
            left_out = value is None and how.null_absent
        except (KeyError, IndexError, TypeError, AttributeError) as exc:
            if how.absent is REQUIRED:
                missing(path, reading, exc)
            value, left_out = None, True
        if left_out and how.absent is not REQUIRED:
            value = how.absent(reading) if callable(how.absent) else how.absent
    return value if how.check is None else how.check(value, f"{reading.source}: field '{dotted(path)}'", reading)


def _lookup(raw: Any, path: tuple[str | int, ...]) -> Any:
    for step in path:
        raw = raw[step]
    return raw

