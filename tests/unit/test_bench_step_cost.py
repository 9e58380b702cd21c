"""The step-cost suite's split of whole decode steps, on small traces written here in the Chrome
trace format torch's profiler exports: the bench's step and scheduler scopes around vLLM's runner
scopes, and, in the trace with Python calls, a drafter module and frames of vllm-edsd's own."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys

import pytest

from bench import step_cost, trace
from bench.report import render

SCOPE, PYTHON = "user_annotation", trace.PYTHON
DECODE_MARK, PREFILL_MARK = "execute_context_0(0)_generation_1(5)", "execute_context_1(12)_generation_0(0)"
STEP_US, GAP_US = 200.0, 10.0  # a decode step's scope, and the front end's loop before the next


def event(name: str, start: float, duration: float, category: str = SCOPE) -> dict:
    return {"ph": "X", "name": name, "cat": category, "ts": start, "dur": duration, "pid": 1, "tid": 1}


def decode_step(start: float, with_python: bool) -> list[dict]:
    """One decode step of 200 µs: scheduler 20, preprocess 20, forward 60 and logits 10, sample
    10, draft 40, bookkeeping 2, the engine core's output 8, the front end's 6; 24 unclaimed.
    With Python calls: a 4-µs frame of vllm-edsd's in the sampling, and the draft as the plugin's
    hook around a 20-µs drafter forward."""
    at = start
    events = [event(step_cost.STEP, at, STEP_US), event(step_cost.STEP_PARTS["scheduler"][0], at + 5, 20),
              event(DECODE_MARK, at + 30, 50), event("gpu_model_runner: preprocess", at + 30, 20),
              event("gpu_model_runner: forward", at + 50, 60), event("gpu_model_runner: postprocess", at + 110, 10),
              event("gpu_model_runner: sample", at + 122, 10), event(trace.DRAFT, at + 135, 40),
              event("gpu_model_runner: bookkeep", at + 176, 2),
              event(step_cost.STEP_PARTS["engine-core output"][0], at + 180, 8),
              event(step_cost.STEP_PARTS["front-end output"][0], at + 190, 6),
              event("aten::copy_", at + 192, 1, "cpu_op")]  # inside a claimed scope: not counted again
    if with_python:
        events += [event("vllm_edsd/serving/repairs/cpu_sampling.py(1): _torch_expansion", at + 123, 4, PYTHON),
                   event("vllm_edsd/serving/hooks.py(1): capped_drafting", at + 135, 40, PYTHON),
                   event(trace.MODULE_CALL + "Drafter_0", at + 140, 20, PYTHON)]
    return events


def write_trace(path, with_python: bool) -> list[trace.Call]:
    """A prefill step, three decode steps (the last without a next step) written to ``path``
    (gzip-compressed), and the call trees read back from it."""
    events = [event(step_cost.STEP, 0, 100), event(PREFILL_MARK, 10, 80)]
    for i in range(3):
        events += decode_step(110 + i * (STEP_US + GAP_US), with_python)
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    return trace.call_trees(trace.read_events(path))


@pytest.fixture
def traces(tmp_path):
    return (write_trace(tmp_path / "timed.pt.trace.json.gz", with_python=False),
            write_trace(tmp_path / "traced.pt.trace.json.gz", with_python=True))


def test_only_decode_steps_with_a_next_step_count(traces):
    timed = step_cost.timed_steps(traces[0])
    assert [step.start for step, _ in timed] == [110, 110 + STEP_US + GAP_US]
    assert [wall for _, wall in timed] == [STEP_US + GAP_US] * 2


def test_parts_are_disjoint_and_the_rest_is_what_none_claims(traces):
    step, _ = step_cost.timed_steps(traces[0])[0]
    times = step_cost.part_times(step)
    assert times == {"scheduler": 20, "input preparation": 20, "target forward": 70, "sampling": 10,
                     step_cost.DRAFT: 40, "worker output": 2, "engine-core output": 8, "front-end output": 6,
                     step_cost.REST: 24}
    assert sum(times.values()) == pytest.approx(STEP_US)


def test_the_plugin_and_the_drafts_parts_come_from_the_python_calls(traces):
    """The traced steps give proportions: 4 of the sampling's 10 µs, and the draft's hook frame
    outside the drafter's forward (20 of 40 µs), are the plugin's."""
    traced = [step for step, _ in step_cost.timed_steps(traces[1])]
    shares = step_cost.plugin_shares(traced)
    assert shares["sampling"] == pytest.approx(0.4)
    assert all(shares[part] == 0 for part in ("scheduler", "target forward", step_cost.REST))
    in_draft = step_cost.draft_shares(traced)
    assert in_draft[trace.DRAFTER_FORWARD] == in_draft[trace.PLUGIN] == pytest.approx(0.5)


def test_the_split_adds_up_to_the_step(traces):
    timed, traced = step_cost.timed_steps(traces[0]), [step for step, _ in step_cost.timed_steps(traces[1])]
    row = step_cost.split(timed, traced)
    parts = row["parts_ms"]
    assert list(parts) == list(step_cost.COLUMNS)
    assert parts["sampling"] == pytest.approx(0.006) and parts["draft: drafter forward"] == pytest.approx(0.020)
    assert parts[step_cost.PLUGIN] == pytest.approx(0.004 + 0.020)
    assert parts["draft: other"] == pytest.approx(0) and parts[step_cost.REST] == pytest.approx(0.024)
    assert row["sum_ms"] == pytest.approx(STEP_US / 1e3)
    assert row["step_ms"] == pytest.approx((STEP_US + GAP_US) / 1e3)
    assert row["sum_over_step"] == pytest.approx(STEP_US / (STEP_US + GAP_US))
    assert row["steps"] == 2


def test_a_trace_without_decode_steps_is_refused(tmp_path):
    from vllm_edsd.errors import EDSDError

    with pytest.raises(EDSDError, match="no decode step"):
        step_cost.split([], [])


def test_the_report_has_a_table_per_batch_size(traces):
    timed, traced = step_cost.timed_steps(traces[0]), [step for step, _ in step_cost.timed_steps(traces[1])]
    rows = [{"suite": "step-cost", "method": method, "k": 4, "batch_size": batch, "overhead": 0.02,
             **step_cost.split(timed, traced)} for batch in (1, 8) for method in ("none", "edsd")]
    machine = {"processor": "cpu", "cores": 2, "accelerator": "none", "vllm": "0", "torch": "0", "vllm_edsd": "0"}
    report = render({"machine": machine, "config": {"target": "t", "drafters": {}, "command": "c"}, "runs": rows})
    assert "### Batch 1" in report and "### Batch 8" in report
    assert "| part | none | edsd K=4 |" in report
    assert "| draft: drafter forward | 0.020 | 0.020 |" in report and "| sum / step | 95.2% | 95.2% |" in report


def test_the_suite_plans_its_methods_batches_and_dtype(tmp_path):
    """Every method and the lookup variants, batch 1 and 8, float32, 32 tokens (8 quick), one
    engine per method; its help is the module's docstring."""
    from bench.cli import parse
    from bench.suites import build_setup, measurements

    args = parse(["step-cost", "--out", str(tmp_path), "--target", "t", "--edsd", "e", "--eagle3", "e3"])
    setup = build_setup(args)
    assert (setup.batch_sizes, setup.dtype, setup.max_tokens) == ([1, 8], "float32", 32)
    assert [label for label, _, _ in measurements(setup, (args.suite,), args)] == [
        f"step-cost {method}" for method in step_cost.METHODS]
    out = subprocess.run([sys.executable, "-m", "bench", "step-cost", "--help"], capture_output=True, text=True,
                         check=True).stdout
    assert "The split." in out and "engine-core output" in out


class SchedulerOutput:
    """What ``Scopes.mark`` reads of vLLM's SchedulerOutput: one new request prefilling 12
    tokens, one decoding with 4 drafts, one decoding without."""

    scheduled_new_reqs = [type("NewRequest", (), {"req_id": "new"})()]
    num_scheduled_tokens = {"new": 12, "drafting": 5, "plain": 1}
    scheduled_spec_decode_tokens = {"drafting": [1, 2, 3, 4]}


def test_scopes_timed_by_the_clock_nest_as_a_trace_does():
    """In clock mode the scopes are complete events that ``trace.call_trees`` nests, with the
    worker's step mark from the scheduler's output; off, they record nothing."""
    scopes = step_cost.Scopes()
    with scopes(step_cost.STEP):
        scopes.mark(SchedulerOutput())
    assert scopes.events == []
    scopes.mode = step_cost.Scopes.CLOCK
    with scopes(step_cost.STEP):
        with scopes(step_cost.SCHEDULE):
            pass
        scopes.mark(SchedulerOutput())
        with scopes("gpu_model_runner: forward"):
            sum(range(1000))
    (step,) = trace.call_trees(scopes.events)
    assert step.name == step_cost.STEP and step.duration > 0
    assert [c.name for c in step.children] == [step_cost.SCHEDULE, "execute_context_1(12)_generation_2(6)",
                                               "gpu_model_runner: forward"]
    assert not trace.decodes_only(step)


def test_a_scopes_cost_is_measured_apart():
    scopes = step_cost.Scopes()
    assert 0 < scopes.cost_us(count=100) < 1000
    assert scopes.mode is None and scopes.events == []
