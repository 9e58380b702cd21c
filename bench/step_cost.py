"""The step-cost suite: where the whole decode step goes, not only the target forward and the
draft: the scheduler, input preparation, the target forward, sampling, the draft and its parts,
vllm-edsd's hooks, output processing in the engine core and in the front end, and the rest.

For each method (default: none, ngram, eagle3, edsd, eagle3+lookup, edsd+lookup) one engine
generates at each batch size (default 1,8) and temperature (--temperatures, default 0: greedy;
above 0 the drafters sample their drafts; ignoring EOS, float32 unless --dtype) with
its engine core and worker in the bench's own process and thread (vLLM's
VLLM_ENABLE_V1_MULTIPROCESSING=0, started in a fresh child process per engine). There the front
end, the scheduler and the worker run one after another, so a step's parts are disjoint slices of
its wall time and nothing waits on a queue. Serving's layout differs: the front end, the engine
core and the worker are three processes that hand each step over through shared memory and spin
while they wait (on 2 cores they also take turns); that hand-off is not in this split.

The split. A step is one call of the front end's ``LLMEngine.step``, measured from its start to
the next step's start (so the front end's loop between steps is in it); only steps in which
every scheduled request decodes, and that have a next step, count. Its parts, by scope, each
claiming the first of its scopes met on the way down (``trace.scope_parts``):

- scheduler: ``Scheduler.schedule`` and ``Scheduler.update_draft_token_ids`` (the drafts' hand-off)
- input preparation: the runner's ``preprocess`` scope (batch state, inputs, attention metadata)
- target forward: the runner's ``forward`` and ``postprocess`` (the logits) scopes
- sampling: the runner's ``sample`` scope (rejection sampling with a drafter)
- draft: the runner's ``draft`` scope, split by ``trace.PARTS`` (drafter forward, logits and
  sampling, fc on target states, attention metadata, input preparation, other)
- worker output: the runner's ``bookkeep`` and ``ModelRunnerOutput`` scopes
- engine-core output: ``Scheduler.update_from_output``
- front-end output: ``OutputProcessor.process_outputs`` (detokenising, request outputs)
- plugin hooks: the own time of vllm-edsd's frames, taken out of whichever part holds them
- rest: the step's time that no part claims (the executor's calls, stats, the loop)

The scopes: vLLM's runner and front end name theirs through ``record_function_or_nullcontext``,
which the bench points at its own ``Scopes`` (in its child process only); the scheduler's and
the output processing's are the bench's (``trace.BENCH_SCOPE``). Each batch size runs three
unprofiled generations, each followed by the same timed: its scopes read the clock alone
(``time.perf_counter_ns``, a few µs per scope, about 20 scopes a step), not the torch profiler,
whose cost per operator would swell the parts with many small operators. Then one generation
under vLLM's torch profiler recording Python calls (``torch_profiler_with_stack``), which slows
Python more than kernels, so it gives only proportions: the draft's split into its parts
(``trace.draft_parts``) and the plugin's share of each part. Means over the timed generations'
steps, in ms. ``sum / step`` is the parts' sum against the steps' start-to-start wall time;
``overhead`` is the timed generations' median wall time against the unprofiled ones', and
``timing cost`` the scopes' own: a step's scopes times one scope's cost, measured apart, against
the step (the wall times of a loaded machine vary more than that).

Writes DIR/results.json and DIR/report.md (a table per method and batch size). ``--quick``: eager
engines, 8 tokens, for CI.
"""

from __future__ import annotations

import functools
import importlib
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import AbstractContextManager, contextmanager, nullcontext
from multiprocessing import get_context
from pathlib import Path

from vllm_edsd.errors import EDSDError
from vllm_edsd.launch.engine import engine_dtype, llm_session
from vllm_edsd.methods.registry import EAGLE3, EDSD

from . import trace
from .draft_cost import written_trace
from .offline import Setup, load_prompts, method_config

SUITE = "step-cost"
METHODS = ("none", "ngram", EAGLE3, EDSD, f"{EAGLE3}+lookup", f"{EDSD}+lookup")
BATCH_SIZES = "1,8"
IN_PROCESS_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
# Unprofiled and profiled generations, taken in turn: the overhead compares their medians, so
# that a change in the machine's load touches both alike; the split pools the profiled ones' steps.
REPEATS = 3

# The functions the bench scopes, (module, class, function): the front end's step, the
# scheduler's and the output processing the runner's own scopes do not cover.
SCOPED = (("vllm.v1.engine.llm_engine", "LLMEngine", "step"),
          ("vllm.v1.core.sched.scheduler", "Scheduler", "schedule"),
          ("vllm.v1.core.sched.scheduler", "Scheduler", "update_draft_token_ids"),
          ("vllm.v1.core.sched.scheduler", "Scheduler", "update_from_output"),
          ("vllm.v1.engine.output_processor", "OutputProcessor", "process_outputs"))


def scope(owner: str, function: str) -> str:
    """The name of the bench's scope around ``owner.function``."""
    return f"{trace.BENCH_SCOPE}{owner}.{function}"


STEP = scope("LLMEngine", "step")
SCHEDULE = scope("Scheduler", "schedule")
RUNNER = "gpu_model_runner: "
DRAFT = "draft"
STEP_PARTS = {
    "scheduler": (SCHEDULE, scope("Scheduler", "update_draft_token_ids")),
    "input preparation": (RUNNER + "preprocess",),
    "target forward": (RUNNER + "forward", RUNNER + "postprocess"),
    "sampling": (RUNNER + "sample",),
    DRAFT: (trace.DRAFT,),
    "worker output": (RUNNER + "bookkeep", RUNNER + "ModelRunnerOutput"),
    "engine-core output": (scope("Scheduler", "update_from_output"),),
    "front-end output": (scope("OutputProcessor", "process_outputs"),),
}
PLUGIN = "plugin hooks"
REST = "rest"
DRAFT_NAMES = tuple(name for name in trace.PART_NAMES if name != trace.PLUGIN)  # the draft's plugin time is PLUGIN's
DRAFT_COLUMNS = tuple(f"{DRAFT}: {name}" for name in DRAFT_NAMES)
# The table's columns, in the step's order.
COLUMNS = (*list(STEP_PARTS)[:4], *DRAFT_COLUMNS, *list(STEP_PARTS)[5:], PLUGIN, REST)


class Scopes:
    """The scopes of vLLM's runner (its ``record_function_or_nullcontext``) and the bench's own
    (``SCOPED``), in one of three modes: off (no cost, the unprofiled generations), ``CLOCK``
    (timed with ``time.perf_counter_ns`` alone into ``events``, Chrome's complete events: the
    timed generations, without the torch profiler's cost per operator) or ``TORCH`` (torch's
    ``record_function``, for vLLM's profiler recording Python calls)."""

    CLOCK, TORCH = "clock", "torch"

    def __init__(self) -> None:
        self.mode: str | None = None
        self.events: list[dict] = []

    def __call__(self, name: str) -> AbstractContextManager:
        if self.mode == self.CLOCK:
            return self._timed(name)
        if self.mode == self.TORCH:
            from torch.autograd.profiler import record_function

            return record_function(name)
        return nullcontext()

    @contextmanager
    def _timed(self, name: str) -> Iterator[None]:
        start = time.perf_counter_ns()
        try:
            yield
        finally:
            self.add(name, start, time.perf_counter_ns())

    def cost_us(self, count: int = 10_000) -> float:
        """µs that one clock-timed scope adds to what it wraps, the fastest of five rounds of
        ``count``: times the scopes of a step, the timing's own cost per step, which a loaded
        machine's noise hides in the generations' wall times."""
        mode, events, rounds = self.mode, self.events, []
        self.mode = self.CLOCK
        for _ in range(5):
            self.events, start = [], time.perf_counter_ns()
            for _ in range(count):
                with self("calibration"):
                    pass
            rounds.append((time.perf_counter_ns() - start) / count / 1e3)
        self.mode, self.events = mode, events
        return min(rounds)

    def add(self, name: str, start_ns: int, end_ns: int) -> None:
        self.events.append({"ph": "X", "name": name, "cat": "user_annotation", "ts": start_ns / 1e3,
                            "dur": (end_ns - start_ns) / 1e3, "pid": 0, "tid": 0})

    def mark(self, scheduler_output) -> None:
        """Where vLLM's profiler is off, the worker's step mark (``trace.STEP``) from what the
        scheduler scheduled: a request prefills where it is new or runs more tokens than one
        plus its drafts."""
        if self.mode != self.CLOCK:
            return
        drafts = scheduler_output.scheduled_spec_decode_tokens
        new = {request.req_id for request in scheduler_output.scheduled_new_reqs}
        counts = scheduler_output.num_scheduled_tokens
        prefilling = {r for r, n in counts.items() if r in new or n > 1 + len(drafts.get(r, ()))}
        tokens = [sum(n for r, n in counts.items() if (r in prefilling) == side) for side in (True, False)]
        now = time.perf_counter_ns()
        self.add(f"execute_context_{len(prefilling)}({tokens[0]})_generation_{len(counts) - len(prefilling)}"
                 f"({tokens[1]})", now, now)


def install_scopes(scopes: Scopes) -> None:
    """Put ``scopes`` in vLLM's place and around ``SCOPED``, for the rest of this process: only
    the bench's child process that measures one engine calls it, never a serving process."""
    from vllm.v1 import utils

    utils._PROFILER_FUNC = scopes  # what vLLM's record_function_or_nullcontext returns its scopes from
    for module, owner, function in SCOPED:
        cls = getattr(importlib.import_module(module), owner)
        original, name = getattr(cls, function), scope(owner, function)

        @functools.wraps(original)
        def scoped(*args, _original=original, _name=name, **kwargs):
            with scopes(_name):
                result = _original(*args, **kwargs)
            if _name == SCHEDULE:
                scopes.mark(result)
            return result

        setattr(cls, function, scoped)


def timed_steps(roots: list[trace.Call]) -> list[tuple[trace.Call, float]]:
    """Each decode-only step that has a next step, with the µs from its start to the next's."""
    steps = trace.matching(roots, lambda c: c.name == STEP)
    return [(step, after.start - step.start) for step, after in zip(steps, steps[1:]) if trace.decodes_only(step)]


def part_times(step: trace.Call) -> dict[str, float]:
    """µs of one step by part of ``STEP_PARTS``, and the rest that none claims."""
    times = {part: sum(c.duration for c in calls) for part, calls in trace.scope_parts(step, STEP_PARTS).items()}
    return times | {REST: step.duration - sum(times.values())}


def plugin_shares(steps: list[trace.Call]) -> dict[str, float]:
    """The share of each part (and of the rest) that vllm-edsd's frames take, over steps traced
    with Python calls; the draft's is left at 0 here (``draft_shares`` splits the draft)."""
    plugin = dict.fromkeys((*STEP_PARTS, REST), 0.0)
    total = dict.fromkeys(plugin, 0.0)
    for step in steps:
        claimed = trace.scope_parts(step, STEP_PARTS)
        for part, calls in claimed.items():
            total[part] += sum(c.duration for c in calls)
            plugin[part] += sum(c.plugin_time() for c in calls if part != DRAFT)
        total[REST] += step.duration - sum(c.duration for calls in claimed.values() for c in calls)
        plugin[REST] += step.plugin_time() - sum(c.plugin_time() for calls in claimed.values() for c in calls)
    return {part: plugin[part] / total[part] if total[part] else 0.0 for part in plugin}


def draft_shares(steps: list[trace.Call]) -> dict[str, float]:
    """Each draft part's share of the drafts of steps traced with Python calls (zeros: no draft)."""
    drafts = [d for step in steps for d in trace.scope_parts(step, {DRAFT: (trace.DRAFT,)})[DRAFT]]
    parts = [trace.draft_parts(d) for d in drafts]
    total = sum(d.duration for d in drafts)
    if None in parts or not total:
        return dict.fromkeys(trace.PART_NAMES, 0.0)
    return {name: sum(p[name] for p in parts) / total for name in trace.PART_NAMES}


def split(timed: list[tuple[trace.Call, float]], traced: list[trace.Call]) -> dict:
    """Mean ms per step by column (``COLUMNS``), their sum and the measured step, from the steps
    timed with scopes alone and the proportions of the steps traced with Python calls."""
    if not timed or not traced:
        raise EDSDError("the profiled generation has no decode step followed by another step")
    per_step = [part_times(step) for step, _ in timed]
    times = {part: statistics.fmean(step[part] for step in per_step) for part in per_step[0]}
    shares, in_draft = plugin_shares(traced), draft_shares(traced)
    outside = [part for part in times if part != DRAFT]
    parts = {part: times[part] * (1 - shares[part]) for part in outside}
    parts |= {column: times[DRAFT] * in_draft[name] for column, name in zip(DRAFT_COLUMNS, DRAFT_NAMES)}
    parts[PLUGIN] = sum(times[part] * shares[part] for part in outside) + times[DRAFT] * in_draft[trace.PLUGIN]
    ms = {column: parts[column] / 1e3 for column in COLUMNS}
    step = statistics.fmean(wall for _, wall in timed) / 1e3
    return {"steps": len(timed), "parts_ms": ms, "sum_ms": sum(ms.values()), "step_ms": step,
            "sum_over_step": sum(ms.values()) / step}


def traced(llm, trace_dir: Path, scopes: Scopes, generate) -> list[trace.Call]:
    """The call trees of one ``generate()`` under vLLM's torch profiler recording Python calls.
    The worker makes its profiler from its config at its first start."""
    worker = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker
    worker.profiler_config.torch_profiler_with_stack = True
    scopes.mode = Scopes.TORCH
    llm.start_profile()
    generate()
    llm.stop_profile()
    scopes.mode = None
    path = written_trace(trace_dir)
    roots = trace.call_trees(trace.read_events(path))
    path.unlink()  # the next batch size's trace is then the folder's only one
    return roots


def clocked(scopes: Scopes, generate) -> tuple[list[trace.Call], float]:
    """The call trees of one ``generate()`` timed by the clock alone, and its wall time (s)."""
    scopes.mode, scopes.events = Scopes.CLOCK, []
    wall = generate()
    scopes.mode = None
    return trace.call_trees(scopes.events), wall


def batch_row(llm, trace_dir: Path, scopes: Scopes, max_tokens: int, batch: int, temperature: float) -> dict:
    """The split of one batch size's decode steps at one temperature: a warm-up, ``REPEATS``
    unprofiled generations in turn with as many timed by the clock (the times), then one under
    vLLM's profiler recording Python calls (the proportions)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True)
    chats = load_prompts("chat", batch)
    prompts = [chats[i % len(chats)] for i in range(batch)]

    def generate() -> float:
        start = time.perf_counter()
        llm.chat(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    generate()  # the warm-up
    unprofiled, timed_walls, timed = [], [], []
    for _ in range(REPEATS):
        unprofiled.append(generate())
        roots, wall = clocked(scopes, generate)
        timed_walls.append(wall)
        timed += timed_steps(roots)
    row = split(timed, [step for step, _ in timed_steps(traced(llm, trace_dir, scopes, generate))])
    scopes_per_step, scope_cost = statistics.fmean(sum(1 for _ in step.walk()) for step, _ in timed), scopes.cost_us()
    return {"batch_size": batch, "temperature": temperature, "dtype": engine_dtype(llm), **row,
            "engine_steps": len(trace.matching(roots, lambda c: c.name == STEP)),
            "scopes_per_step": scopes_per_step, "scope_cost_us": scope_cost,
            "timing_cost_share": scopes_per_step * scope_cost / 1e3 / row["step_ms"],
            "unprofiled_wall_s": unprofiled, "timed_wall_s": timed_walls,
            "overhead": statistics.median(timed_walls) / statistics.median(unprofiled) - 1}


def measure(setup: Setup, method: str, k: int) -> list[dict]:
    """One row per temperature and batch size of (method, K), from one engine whose core and
    worker run in this process, a child of the bench's made for it (``install_scopes`` stays in
    it). Drafters sample their drafts at a temperature above 0 (``draft_sample_method``
    probabilistic, as the server's EDSD does by default)."""
    os.environ[IN_PROCESS_ENV] = "0"
    scopes = Scopes()
    install_scopes(scopes)
    dtype = {"dtype": setup.dtype} if setup.dtype else {}
    with tempfile.TemporaryDirectory(prefix="bench-step-cost-") as trace_dir:
        profiler = {"profiler": "torch", "torch_profiler_dir": trace_dir}
        config = method_config(setup, method, k, draft_sample_method="probabilistic")
        with llm_session(setup.target, config, profiler_config=profiler, enforce_eager=setup.eager, **dtype) as llm:
            rows = [batch_row(llm, Path(trace_dir), scopes, setup.max_tokens, batch, temperature)
                    for temperature in setup.temperatures for batch in setup.batch_sizes]
    return [{"suite": SUITE, "method": method, "k": k, "max_tokens": setup.max_tokens, **row} for row in rows]


def step_cost(setup: Setup, method: str, k: int) -> list[dict]:
    """``measure`` in a fresh child process: the engine core in the caller's process cannot
    start several engines one after another there (docs/known-issues.md), and the scopes stay
    out of the bench's own process."""
    with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
        return pool.submit(measure, setup, method, k).result()

