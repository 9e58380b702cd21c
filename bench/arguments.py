"""What every bench script reads alike from its command line: comma-separated number lists
(``--k 1,2,4``, ``--sizes``...) and the models, the embedded demo's where none is given, so that a
bad value is the same one line everywhere."""

from __future__ import annotations

from vllm_edsd.errors import EDSDError
from vllm_edsd.methods.registry import EAGLE3, EDSD


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


def models_or_demo(target: str | None, drafters: dict[str, str]) -> tuple[str, dict[str, str]]:
    """The target and drafters given, the embedded demo's filling in where no target is given
    (a drafter given wins over the demo's)."""
    if target is not None:
        return target, drafters
    from vllm_edsd.demo import demo_paths

    try:
        paths = demo_paths()
    except EDSDError as exc:
        raise EDSDError(f"no demo models in this installation ({exc}); pass --target and a drafter") from exc
    return paths["target"], {m: paths[m] for m in (EDSD, EAGLE3) if m in paths} | drafters


def target_and_drafter(target: str | None, method: str, drafter: str | None) -> tuple[str, str | None]:
    """The target and ``method``'s drafter (None for ``none``), the demo's where no target is
    given; a target given without its drafter is refused (the demo's drafters are for the demo's
    target only)."""
    target, drafters = models_or_demo(target, {method: drafter} if drafter else {})
    if method == "none":
        return target, None
    if method not in drafters:
        raise EDSDError(f"no {method} drafter: pass --drafter")
    return target, drafters[method]
