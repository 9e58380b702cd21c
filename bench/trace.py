"""Reading a trace of vLLM's torch profiler: the target forward and the draft of each decode step.

vLLM's V1 model runner wraps the target's forward in ``gpu_model_runner: forward`` and the
proposer in ``gpu_model_runner: draft`` (``record_function`` scopes, on with
``VLLM_CUSTOM_SCOPES_FOR_PROFILING=1``), and the worker names every step it profiles
``execute_context_C(c)_generation_G(g)`` (C prefilling requests of c tokens, G decoding ones of
g). A trace is Chrome's trace format, as ``torch.profiler`` exports it (``.json`` or
``.json.gz``); calls nest by time within a thread. With ``torch_profiler_with_stack`` the
trace also holds every Python call (``python_function``), which is what splits a draft into
its parts (``draft_parts``). See docs/architecture.md ("Patches") for the proposer's hooks.

The step-cost suite adds scopes of its own (``BENCH_SCOPE``) around the engine's step and the
scheduler's and front end's functions, and splits a whole step by scope names (``scope_parts``).
"""

from __future__ import annotations

import gzip
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

FORWARD = "gpu_model_runner: forward"
DRAFT = "gpu_model_runner: draft"
STEP = re.compile(r"execute_context_(\d+)\((\d+)\)_generation_(\d+)\((\d+)\)")
PYTHON = "python_function"
MODULE_CALL = "nn.Module: "  # how the Python tracer names an nn.Module's call
PLUGIN_FILES = "vllm_edsd/"
BENCH_SCOPE = "bench: "  # the step-cost suite's own record_function scopes: "bench: Class.function"
# Timestamps are microseconds with nanosecond fractions; a child may end a rounding error late.
SLACK_US = 0.01

# The parts of a draft, by the functions of vLLM's EAGLE proposer (0.32) whose calls make
# them; the first of these met on the way down a call tree claims the call, and calls inside
# it are not counted again. The drafter's forward is the outermost nn.Module call left. A
# draft step's sampling is vLLM's ``_sample_draft_tokens`` or, where the plugin hooked it, the
# plugin's limiter around it (``sample_draft_tokens``; serving/draft_vocab.py samples inside).
PARTS = (
    ("logits and sampling", ("_sample_draft_tokens", "sample_draft_tokens")),
    ("fc on target states", ("combine_hidden_states",)),
    ("attention metadata", ("build_per_group_and_layer_attn_metadata", "_update_positions_dependent_metadata")),
    ("input preparation", ("prepare_next_token_ids_padded", "prepare_inputs_padded", "set_inputs_first_pass",
                           "build_model_inputs_first_pass")),
)
DRAFTER_FORWARD = "drafter forward"
PLUGIN = "plugin hooks"
OTHER = "other"
PART_NAMES = (DRAFTER_FORWARD, *(name for name, _ in PARTS), PLUGIN, OTHER)


@dataclass
class Call:
    """One complete event ("ph": "X") and the events inside it."""

    name: str
    category: str
    start: float  # microseconds
    duration: float
    children: list[Call] = field(default_factory=list)

    @property
    def end(self) -> float:
        return self.start + self.duration

    def contains(self, other: Call) -> bool:
        return self.start <= other.start and other.end <= self.end + SLACK_US

    def walk(self) -> Iterator[Call]:
        """This call and every call inside it, depth first."""
        yield self
        for child in self.children:
            yield from child.walk()

    @property
    def function(self) -> str:
        """A Python call's function name (``path(line): name`` -> ``name``), else the event's name."""
        return self.name.rsplit("): ", 1)[-1] if self.category == PYTHON else self.name

    @property
    def in_plugin(self) -> bool:
        """A Python call of a function defined in vllm-edsd."""
        return self.category == PYTHON and PLUGIN_FILES in self.name.split("): ", 1)[0]

    @property
    def self_time(self) -> float:
        return self.duration - sum(child.duration for child in self.children)

    def plugin_time(self) -> float:
        """The own time of vllm-edsd's frames in this call, at any depth (Python calls only)."""
        return sum(call.self_time for call in self.walk() if call.in_plugin)


@dataclass
class Step:
    """One decode step: its target forward and the draft that followed (None without one)."""

    tokens: int
    forward: Call
    draft: Call | None


def read_events(path: Path) -> list[dict]:
    """The complete events of a trace file (gzip-compressed or not)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and "dur" in e]


def call_trees(events: list[dict]) -> list[Call]:
    """The outermost calls of every thread, each holding the calls made inside it, in time order."""
    threads: dict[tuple, list[dict]] = {}
    for event in events:
        threads.setdefault((event.get("pid"), event.get("tid")), []).append(event)
    roots: list[Call] = []
    for thread in threads.values():
        roots += _nest(sorted(thread, key=lambda e: (e["ts"], -e["dur"])))
    return sorted(roots, key=lambda c: c.start)


def _nest(events: list[dict]) -> list[Call]:
    roots: list[Call] = []
    open_calls: list[Call] = []
    for event in events:
        call = Call(event["name"], event.get("cat", ""), float(event["ts"]), float(event["dur"]))
        while open_calls and not open_calls[-1].contains(call):
            open_calls.pop()
        (open_calls[-1].children if open_calls else roots).append(call)
        open_calls.append(call)
    return roots


def matching(roots: list[Call], predicate: Callable[[Call], bool]) -> list[Call]:
    """Every call, at any depth, that ``predicate`` accepts, in time order."""
    return sorted((c for root in roots for c in root.walk() if predicate(c)), key=lambda c: c.start)


def decode_steps(roots: list[Call]) -> list[Step]:
    """The steps in which every scheduled request decodes (no prefill), each with its target
    forward and the draft scope that ran after it, before the next step."""
    marks = matching(roots, lambda c: STEP.fullmatch(c.name) is not None)
    drafts = matching(roots, lambda c: c.name == DRAFT)
    steps = []
    for i, mark in enumerate(marks):
        prefilling, _, decoding, tokens = (int(g) for g in STEP.fullmatch(mark.name).groups())
        forwards = [c for c in mark.walk() if c.name == FORWARD]
        if prefilling or not decoding or not forwards:
            continue
        until = marks[i + 1].start if i + 1 < len(marks) else float("inf")
        draft = next((d for d in drafts if mark.end <= d.start < until), None)
        steps.append(Step(tokens, forwards[0], draft))
    return steps


def draft_parts(draft: Call) -> dict[str, float] | None:
    """Microseconds of one draft scope by part (``PART_NAMES``); None when the trace has no
    Python calls (the profiler ran without ``with_stack``). ``plugin hooks`` is the time spent
    in vllm-edsd's own frames around vLLM's (the drafter's forward is its own part);
    ``other`` is what no part claims."""
    if not any(c.category == PYTHON for c in draft.walk()):
        return None
    parts = dict.fromkeys(PART_NAMES, 0.0)
    for part, call in _claimed(draft):
        parts[part] += call.self_time if part == PLUGIN else call.duration
    parts[OTHER] = draft.duration - sum(parts.values())
    return parts


def drafter_forwards(draft: Call) -> int:
    """How many drafter forwards a draft scope ran; 0 without Python calls in the trace."""
    return sum(part == DRAFTER_FORWARD for part, _ in _claimed(draft))


def _claimed(call: Call) -> Iterator[tuple[str, Call]]:
    """(part, call) for the calls inside ``call`` that a part claims, outermost first, and
    (``PLUGIN``, frame) for vllm-edsd's frames outside them (their own time is the plugin's)."""
    for child in call.children:
        part = _part_of(child)
        if part is not None:
            yield part, child
            continue
        if child.in_plugin:
            yield PLUGIN, child
        yield from _claimed(child)


def _part_of(call: Call) -> str | None:
    if call.category != PYTHON:
        return None
    for part, functions in PARTS:
        if call.function in functions:
            return part
    return DRAFTER_FORWARD if call.name.startswith(MODULE_CALL) else None


def decodes_only(call: Call) -> bool:
    """Whether ``call`` holds the worker's step marks and every one is a step that only decodes."""
    marks = [STEP.fullmatch(c.name) for c in call.walk()]
    counts = [tuple(int(g) for g in mark.groups()) for mark in marks if mark is not None]
    return bool(counts) and all(prefilling == 0 and decoding > 0 for prefilling, _, decoding, _ in counts)


def scope_parts(step: Call, parts: dict[str, tuple[str, ...]]) -> dict[str, list[Call]]:
    """The calls inside ``step`` that each part claims by scope name; the first scope met on the
    way down a call tree claims it, and scopes inside it are not claimed again, so a part's calls
    never overlap another's and their durations add up to at most the step."""
    owner = {name: part for part, names in parts.items() for name in names}
    claimed: dict[str, list[Call]] = {part: [] for part in parts}
    pending = list(step.children)
    while pending:
        call = pending.pop()
        if call.name in owner:
            claimed[owner[call.name]].append(call)
        else:
            pending += call.children
    return claimed
