"""How vllm-edsd replaces a vLLM attribute: once, by name, with a reason, logged.

Every replacement the plugin makes is a ``Patch`` in ``plugin.PATCHES`` (the table, see
docs/architecture.md, "Patches"), as ArcticInference lists its own. A patch wraps the
attribute it names exactly once per process (vLLM loads plugins in every process and may
import this package again), and says so once at debug level.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("vllm.edsd")  # a child of vLLM's logger: its handlers and level

_MARK = "_edsd_patch"


@dataclass(frozen=True)
class Patch:
    """``owner.attribute = replace(original)``; ``owner`` is ``"module"`` or ``"module:Class"``."""

    owner: str
    attribute: str
    why: str
    replace: Callable[[Callable], Callable]
    when: str = "at plugin load"
    only_if: Callable[[], bool] | None = None  # checked at plugin load
    at_load: bool = True  # False: applied later by the code that decides it is needed

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
    """Whether ``patch`` is in place in this process (False where this vLLM lacks its target)."""
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
