"""The draft-cost suite: what one draft step costs against one target step, read from vLLM's
own profiler.

For each method, compilation mode and dtype, one engine generates for one chat prompt (batch 1,
greedy, ignoring EOS) under vLLM's torch profiler, with vLLM's ``record_function`` scopes on
(``VLLM_CUSTOM_SCOPES_FOR_PROFILING=1``); ``trace.py`` reads each decode step's target forward
(verifying K+1 tokens) and draft (K drafter forwards and their bookkeeping) from the trace.
A drafting method then runs a second engine whose profiler also records Python calls
(``torch_profiler_with_stack``), which splits the draft into its parts; the Python tracer
slows what it records (Python more than kernels), so the times and ratios come from the first
engine and only the split from the second. Medians over the decode steps.
"""

from __future__ import annotations

import os
import statistics
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from vllm_edsd.errors import EDSDError
from vllm_edsd.launch.engine import engine_dtype, llm_session
from vllm_edsd.methods.registry import EAGLE3, EDSD

from . import trace
from .offline import Setup, load_prompts, method_config

SUITE = "draft-cost"
METHODS = ("none", EAGLE3, EDSD)  # the target alone, vLLM's EAGLE-3, EDSD through the plugin
MODES = {"compiled": {}, "eager": {"enforce_eager": True}}
DTYPES = ("float32", "bfloat16", "float16")
SCOPES_ENV = "VLLM_CUSTOM_SCOPES_FOR_PROFILING"


@contextmanager
def profiler_scopes() -> Iterator[None]:
    """vLLM's runner scopes on in the engines started meanwhile (they read the environment)."""
    before = os.environ.get(SCOPES_ENV)
    os.environ[SCOPES_ENV] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ[SCOPES_ENV]
        else:
            os.environ[SCOPES_ENV] = before


def profile(setup: Setup, method: str, k: int, mode: str, dtype: str, with_stack: bool) -> tuple[list, str]:
    """The decode steps of one profiled generation (after one unprofiled warm-up), and the
    engine's dtype."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=setup.max_tokens, ignore_eos=True)
    prompt = load_prompts("chat", 1)
    with tempfile.TemporaryDirectory(prefix="bench-draft-cost-") as trace_dir, profiler_scopes():
        profiler = {"profiler": "torch", "torch_profiler_dir": trace_dir, "torch_profiler_with_stack": with_stack}
        with llm_session(setup.target, method_config(setup, method, k), dtype=dtype, profiler_config=profiler,
                         **MODES[mode]) as llm:
            llm.chat(prompt, params, use_tqdm=False)
            llm.start_profile()
            llm.chat(prompt, params, use_tqdm=False)
            llm.stop_profile()
            used = engine_dtype(llm)
        return trace.decode_steps(trace.call_trees(trace.read_events(written_trace(Path(trace_dir))))), used


def written_trace(directory: Path) -> Path:
    """The one trace vLLM's worker wrote into ``directory``."""
    found = sorted(directory.glob("*.pt.trace.json*"))
    if len(found) != 1:
        raise EDSDError(f"expected one trace from vLLM's profiler in {directory}, found {len(found)}")
    return found[0]


def timings(steps: list[trace.Step], k: int) -> dict:
    """Median target forward and draft of the decode steps, in ms, and their ratios."""
    if not steps:
        raise EDSDError("the profiled generation has no decode step")
    target = statistics.median(s.forward.duration for s in steps) / 1e3
    drafts = [s.draft.duration for s in steps if s.draft is not None]
    row = {"steps": len(steps), "tokens_per_forward": statistics.median(s.tokens for s in steps),
           "t_target_ms": target}
    if drafts:
        draft = statistics.median(drafts) / 1e3
        row |= {"t_draft_ms": draft, "draft_over_target": draft / target,
                "per_draft_forward_over_target": draft / k / target}
    return row


def split(steps: list[trace.Step]) -> dict:
    """The mean draft step by part (ms) and its drafter forwards, from a trace with Python calls,
    beside that trace's own median target forward and draft."""
    drafts = [s.draft for s in steps if s.draft is not None]
    parts = [trace.draft_parts(d) for d in drafts]
    if not drafts or None in parts:
        raise EDSDError("the traced generation has no draft step with Python calls")
    return {"draft_parts_ms": {name: statistics.fmean(p[name] for p in parts) / 1e3 for name in trace.PART_NAMES},
            "drafter_forwards": statistics.median(trace.drafter_forwards(d) for d in drafts),
            "traced_t_target_ms": statistics.median(s.forward.duration for s in steps) / 1e3,
            "traced_t_draft_ms": statistics.median(d.duration for d in drafts) / 1e3}


def draft_cost(setup: Setup, method: str, k: int, mode: str, dtype: str) -> list[dict]:
    """One row: the timings of (method, mode, dtype) and, for a drafting method, its draft's parts."""
    steps, used = profile(setup, method, k, mode, dtype, with_stack=False)
    row = {"suite": SUITE, "method": method, "k": k, "mode": mode, "dtype": used,
           "max_tokens": setup.max_tokens, "batch_size": 1, "temperature": 0.0, **timings(steps, k)}
    if method != "none":
        row |= split(profile(setup, method, k, mode, dtype, with_stack=True)[0])
    return [row]
