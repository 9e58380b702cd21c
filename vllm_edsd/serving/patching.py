"""Every change vllm-edsd makes to vLLM, as one table of ``Patch`` rows, and how a replacement
is made: once, by name, with a reason, logged.

The table is ``patches.PATCHES`` (docs/architecture.md, "Patches"), as ArcticInference lists
its own. A row of kind ``REPLACE`` wraps the attribute it names exactly once per process
(vLLM loads plugins in every process and may import this package again), and says so once at
debug level. The other kinds describe a change the plugin's own code makes (a hook on an
instance, a private attribute, an environment variable...): the row names that code
(``where``), and tests/unit/test_serving_patches.py fails on any such change the rows do not name.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("vllm.edsd")  # a child of vLLM's logger: its handlers and level

_MARK = "_edsd_patch"

# What a row changes.
REPLACE = "replace"  # a class's or module's attribute, replaced by ``Patch.apply``
INSTANCE_HOOK = "instance hook"  # an attribute set on instances of the owner
PRIVATE = "private attribute"  # a private attribute of the owner, read or written
OVERRIDE = "override"  # a private method of the owner, overridden in a subclass
CONFIG = "config attribute"  # an attribute set on the config object the owner names
ENVIRONMENT = "environment"  # an environment variable of the whole process, read by the owner
EXCEPTION = "exception"  # an exception of the plugin's, raised through the owner's code
ADDED = "added"  # an attribute vLLM does not have, added to the owner
KINDS = (REPLACE, INSTANCE_HOOK, PRIVATE, OVERRIDE, CONFIG, ENVIRONMENT, EXCEPTION, ADDED)

OUTSIDE_RANGE = "any other"  # ``versions`` of a row made only outside the supported range (patches.REFUSAL)
_SPAN = re.compile(r"(\d+)\.(\d+)(?:\s*[–-]\s*(\d+)\.(\d+))?")


def minor_spans(versions: str) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """The vLLM minors a row's ``versions`` names, as inclusive (first, last) spans: ``"0.24–0.30"``
    or ``"0.27, 0.32"``, a note in parentheses after them. Any other text is a ValueError, so
    that scripts/check_vllm_range.py can tell which releases each row claims and check it there."""
    spans = []
    for part in versions.split("(", 1)[0].split(","):
        match = _SPAN.fullmatch(part.strip())
        if match is None:
            raise ValueError(f"versions {versions!r}: expected minors such as '0.24–0.30' or '0.27, 0.32'")
        first = (int(match[1]), int(match[2]))
        spans.append((first, (int(match[3]), int(match[4])) if match[3] else first))
    return spans


def source_path(target: str) -> str:
    """The ``where`` form of ``"package.module:qualified.name"`` (a registry's ``"module:Class"``):
    ``"package/module.py:qualified.name"``."""
    module, _, name = target.partition(":")
    return f"{module.replace('.', '/')}.py:{name}"


@dataclass(frozen=True)
class Patch:
    """One change to vLLM: ``owner.attribute``, why, when, and in which vLLM releases.

    ``owner`` is ``"module"``, ``"module:Class"`` or, for a config, ``"module:Class.attribute"``
    (the object the class holds). A ``REPLACE`` row is ``owner.attribute = replace(original)``;
    any other row has no ``replace`` and names the functions that make the change, as
    ``"path/of/module.py:qualified.name"`` (``where``). ``versions``: the vLLM minors the change is
    made in (``minor_spans``); None: every release the plugin supports (``versions.SUPPORTED_VLLM``);
    ``OUTSIDE_RANGE``: only the others."""

    owner: str
    attribute: str
    why: str
    replace: Callable[[Callable], Callable] | None = None
    when: str = "at plugin load"
    only_if: Callable[[], bool] | None = None  # checked at plugin load
    at_load: bool = True  # False: applied later by the code that decides it is needed
    kind: str = REPLACE
    versions: str | None = None
    where: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.versions not in (None, OUTSIDE_RANGE):
            minor_spans(self.versions)  # a text the range check cannot read fails here, at import

    @classmethod
    def made_by(cls, kind: str, owner: str, attribute: str, why: str, *, where: tuple[str, ...], when: str,
                versions: str | None = None) -> Patch:
        """A row for a change the plugin's own code makes (``where``), not ``Patch.apply``."""
        return cls(owner, attribute, why, when=when, at_load=False, kind=kind, versions=versions, where=where)

    def claims(self, version: str) -> bool:
        """Whether the row says it is made in vLLM ``version`` (``"0.30.0"``); a row without
        ``versions`` claims every release (the caller knows the supported range)."""
        if self.versions is None:
            return True
        if self.versions == OUTSIDE_RANGE:
            return False
        minor = tuple(int(part) for part in version.split(".")[:2])
        return any(first <= minor <= last for first, last in minor_spans(self.versions))

    @property
    def name(self) -> str:
        return f"{self.owner.replace(':', '.')}.{self.attribute}"

    @property
    def mark(self) -> str:
        """What a replacement carries to say which patch made it (two patches of one attribute
        for different vLLMs are told apart)."""
        return f"{self.name}: {self.why}"

    def resolve(self) -> Any:
        module, _, cls = self.owner.partition(":")
        host = importlib.import_module(module)
        return getattr(host, cls) if cls else host

    def apply(self) -> bool:
        """Replace the attribute unless this process already did; True when it did now."""
        if self.replace is None:
            raise TypeError(f"{self.name}: a {self.kind!r} row is made by {', '.join(self.where)}, not applied")
        host = self.resolve()
        static = inspect.getattr_static(host, self.attribute)
        if applied(self):
            return False
        replacement = functools.wraps(_unwrap_static(host, self.attribute))(self.replace(getattr(host, self.attribute)))
        setattr(replacement, _MARK, self.mark)
        if isinstance(static, classmethod):
            replacement = classmethod(_drop_first_argument(replacement))
        elif isinstance(static, staticmethod):
            replacement = staticmethod(replacement)
        setattr(host, self.attribute, replacement)
        logger.debug("vllm-edsd: replaced %s (%s): %s", self.name, self.when, self.why)
        return True


def applied(patch: Patch) -> bool:
    """Whether ``patch`` is in place in this process (False where this vLLM lacks its target, and
    for a row that ``Patch.apply`` does not make)."""
    if patch.replace is None:
        return False
    try:
        current = _unwrap_static(patch.resolve(), patch.attribute)
    except (ImportError, AttributeError):
        return False
    return getattr(current, _MARK, None) == patch.mark


def _unwrap_static(host: Any, attribute: str) -> Any:
    """The function behind a class- or static method, the attribute itself otherwise."""
    static = inspect.getattr_static(host, attribute)
    return static.__func__ if isinstance(static, (classmethod, staticmethod)) else static


def _drop_first_argument(function: Callable) -> Callable:
    """A classmethod's replacement wraps the *bound* original, so it ignores ``cls``."""

    @functools.wraps(function)
    def bound(_cls: type, *args: Any, **kwargs: Any) -> Any:
        return function(*args, **kwargs)

    setattr(bound, _MARK, getattr(function, _MARK))
    return bound
