"""Comparing replies by their token ids: where a drafted reply parts from the target's own."""

from __future__ import annotations


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two replies' token ids part (one ending early counts there);
    None when they are equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
