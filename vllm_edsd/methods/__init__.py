"""The drafting methods, one folder each, and the registry that maps a method's name to
everything it has (``registry.Method``): reference model, layouts, vLLM model, training
defaults. Adding a method is a folder and one line of ``METHODS``."""

from __future__ import annotations

from collections.abc import Iterable

from vllm_edsd.checkpoint.layouts import Layout
from vllm_edsd.checkpoint.layouts import detect_layout as detect_layout_among
from vllm_edsd.errors import EDSDError
from vllm_edsd.methods import eagle3, edsd
from vllm_edsd.methods.registry import Method

METHODS: dict[str, Method] = {m.name: m for m in (edsd.METHOD, eagle3.METHOD)}
EDSD_METHOD, EAGLE3_METHOD = edsd.METHOD, eagle3.METHOD
LAYOUTS: tuple[Layout, ...] = tuple(layout for m in METHODS.values() for layout in m.layouts)


def method(name: str) -> Method:
    """The registered method ``name``; an unknown name is refused with the known ones."""
    try:
        return METHODS[name]
    except KeyError:
        raise EDSDError(f"unknown method {name!r}; known: {', '.join(METHODS)}") from None


def method_of(layout: Layout) -> Method:
    """The method whose drafters come in ``layout``."""
    return next(m for m in METHODS.values() if layout in m.layouts)


def detect_layout(raw: dict, tensor_names: Iterable[str], *, source: str) -> Layout:
    """Which registered layout a drafter's config.json and tensor names are in."""
    return detect_layout_among(raw, tensor_names, LAYOUTS, source=source)
