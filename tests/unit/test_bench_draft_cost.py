"""The draft-cost suite's reading of a profiler trace, on traces that torch.profiler writes here
for engine-like steps: vLLM's scope and step names around a small target and drafter, the
functions of vLLM's EAGLE proposer that name the draft's parts, and a frame of vllm-edsd's own."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.autograd.profiler import record_function
from torch.profiler import ProfilerActivity, profile

from bench import trace
from bench.draft_cost import timings
from bench.report import render
from vllm_edsd.serving.features import draft_length

K = 3
DECODE_STEPS = 3


class Drafter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x).relu()


def _sample_draft_tokens(head: nn.Linear, hidden: torch.Tensor) -> torch.Tensor:  # vLLM's name
    return head(hidden).argmax(dim=-1)


def build_per_group_and_layer_attn_metadata(positions: torch.Tensor) -> torch.Tensor:  # vLLM's name
    return positions.cumsum(0)


def propose(drafter: Drafter, head: nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    build_per_group_and_layer_attn_metadata(torch.arange(16))
    tokens = []
    for _ in range(K):
        hidden = drafter(hidden)
        tokens.append(_sample_draft_tokens(head, hidden))
    return torch.stack(tokens, dim=1)


def engine_step(target: nn.Module, drafter: Drafter, head: nn.Linear, prefill: bool) -> None:
    """What vLLM's worker records for one step: the step mark around the target's forward, then
    the draft scope (here with the plugin's per-request caps read first, as its hook does)."""
    mark = "execute_context_1(12)_generation_0(0)" if prefill else f"execute_context_0(0)_generation_1({K + 1})"
    x = torch.randn(K + 1, 64)
    with record_function(mark), record_function(trace.FORWARD):
        hidden = target(x)
    with record_function(trace.DRAFT):
        draft_length.request_caps(["request-0"], {}, K)
        propose(drafter, head, hidden[-1:])


def traced(path, with_stack: bool) -> dict[str, list[float]]:
    """Profile the steps into ``path``; the durations (µs) torch recorded for the forward and draft
    scopes, in order, read before the export (torch's event names can be unreadable after it)."""
    target = nn.Sequential(*(nn.Linear(64, 64) for _ in range(8)))
    drafter, head = Drafter(), nn.Linear(64, 32)
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU], with_stack=with_stack) as prof:
        for step in range(1 + DECODE_STEPS):
            engine_step(target, drafter, head, prefill=step == 0)
    recorded = {name: [e.time_range.elapsed_us() for e in sorted((e for e in prof.events() if e.name == name),
                                                                 key=lambda e: e.time_range.start)]
                for name in (trace.FORWARD, trace.DRAFT)}
    prof.export_chrome_trace(str(path))
    return recorded


# torch's profiler now and then returns event names it cannot decode (UnicodeDecodeError in
# ``prof.events()``, more often after other tests in one process): the steps are profiled in a
# fresh process, and profiled again when torch's own reading of its events failed that way.
TORCH_UNREADABLE_EVENTS = "UnicodeDecodeError"
PROFILE_ATTEMPTS = 3
PROFILE_IN_A_FRESH_PROCESS = """
import json, sys
sys.path[:0] = [sys.argv[3], sys.argv[4]]
from test_bench_draft_cost import traced
print(json.dumps(traced(sys.argv[1], with_stack=sys.argv[2] == "stack")))
"""


def traced_apart(path: Path, with_stack: bool) -> dict[str, list[float]]:
    """``traced`` in a fresh process."""
    here = Path(__file__).resolve().parent
    for _ in range(PROFILE_ATTEMPTS):
        out = subprocess.run([sys.executable, "-c", PROFILE_IN_A_FRESH_PROCESS, str(path),
                              "stack" if with_stack else "no-stack", str(here), str(here.parent)],
                             capture_output=True, text=True, timeout=300, cwd=here.parents[1])
        if out.returncode == 0 or TORCH_UNREADABLE_EVENTS not in out.stderr:
            break
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def stack_trace(tmp_path_factory):
    path = tmp_path_factory.mktemp("trace") / "rank0.pt.trace.json.gz"
    recorded = traced_apart(path, with_stack=True)
    return trace.decode_steps(trace.call_trees(trace.read_events(path))), recorded


def test_decode_steps_pair_each_target_forward_with_its_draft(stack_trace):
    """The prefill step is left out; every decode step has its forward and the draft after it,
    with the durations torch's own profiler recorded for those scopes."""
    steps, recorded = stack_trace
    assert len(steps) == DECODE_STEPS
    assert all(s.tokens == K + 1 and s.draft is not None and s.draft.start >= s.forward.end for s in steps)
    for name, parsed in ((trace.FORWARD, [s.forward for s in steps]), (trace.DRAFT, [s.draft for s in steps])):
        assert [c.duration for c in parsed] == pytest.approx(recorded[name][1:], abs=0.01)


def test_a_draft_splits_into_the_proposers_parts(stack_trace):
    """The drafter's K forwards, the sampling and the attention metadata are found by vLLM's
    function names, vllm-edsd's own frame as plugin time; the parts add up to the draft."""
    steps, _ = stack_trace
    for step in steps:
        parts = trace.draft_parts(step.draft)
        assert set(parts) == set(trace.PART_NAMES)
        for name in (trace.DRAFTER_FORWARD, "logits and sampling", "attention metadata", trace.PLUGIN):
            assert parts[name] > 0, name
        assert parts["fc on target states"] == parts["input preparation"] == 0  # not called here
        assert parts[trace.OTHER] >= 0
        assert sum(parts.values()) == pytest.approx(step.draft.duration)
        assert trace.drafter_forwards(step.draft) == K
        modules = [c for c in step.draft.walk() if c.name.startswith(trace.MODULE_CALL + "Drafter")]
        assert parts[trace.DRAFTER_FORWARD] == pytest.approx(sum(c.duration for c in modules))


def test_without_python_calls_the_draft_has_no_parts(tmp_path):
    """A trace without with_stack still gives the timings, and no split of the draft."""
    path = tmp_path / "rank0.pt.trace.json"
    traced_apart(path, with_stack=False)
    steps = trace.decode_steps(trace.call_trees(trace.read_events(path)))
    assert len(steps) == DECODE_STEPS and all(s.draft is not None for s in steps)
    assert all(trace.draft_parts(s.draft) is None and trace.drafter_forwards(s.draft) == 0 for s in steps)


def test_row_and_report_from_the_steps(stack_trace):
    steps, _ = stack_trace
    row = {"suite": "draft-cost", "method": "edsd", "k": K, "mode": "eager", "dtype": "float32",
           **timings(steps, K)}
    target = sorted(s.forward.duration for s in steps)[1] / 1e3  # the median of three
    draft = sorted(s.draft.duration for s in steps)[1] / 1e3
    assert row["steps"] == DECODE_STEPS and row["t_target_ms"] == pytest.approx(target)
    assert row["draft_over_target"] == pytest.approx(draft / target)
    assert row["per_draft_forward_over_target"] == pytest.approx(draft / K / target)
    machine = {"processor": "cpu", "cores": 2, "accelerator": "none", "vllm": "0", "torch": "0", "vllm_edsd": "0"}
    report = render({"machine": machine, "config": {"target": "t", "drafters": {}, "command": "c"}, "runs": [row]})
    assert "Draft-step cost" in report
    assert f"| edsd | {K} | eager | float32 | {DECODE_STEPS} | {target:.2f} | {draft:.2f} |" in report


def test_the_suite_is_in_the_help():
    out = subprocess.run([sys.executable, "-m", "bench", "--help"], capture_output=True, text=True, check=True).stdout
    assert "draft-cost" in out
    out = subprocess.run([sys.executable, "-m", "bench", "draft-cost", "--help"], capture_output=True, text=True,
                         check=True).stdout
    assert "--modes" in out and "--dtypes" in out


def test_steps_of_the_suite_and_its_refusals(tmp_path, capsys):
    """draft-cost alone measures none, eagle3 and edsd per dtype and mode (not in "all"); a
    method it cannot profile is skipped with a note, an unknown mode refused before any engine."""
    from bench.cli import parse
    from bench.suites import SUITES, build_setup, measurements
    from vllm_edsd.errors import EDSDError

    def steps(*extra):
        args = parse(["draft-cost", "--out", str(tmp_path), "--target", "t", "--edsd", "e", "--eagle3", "e3", *extra])
        return [label for label, _, _ in measurements(build_setup(args), (args.suite,), args)]

    assert steps("--dtypes", "float32", "--modes", "eager,compiled") == [
        f"draft-cost {method} {mode} float32" for mode in ("eager", "compiled")
        for method in ("none", "eagle3", "edsd")]
    assert steps("--methods", "ngram,edsd", "--dtypes", "bfloat16", "--modes", "eager") == [
        "draft-cost edsd eager bfloat16"]
    assert "skipping ngram: draft-cost profiles none, eagle3, edsd" in capsys.readouterr().err
    with pytest.raises(EDSDError, match="unknown mode or dtype jit"):
        steps("--modes", "jit")
    args = parse(["all", "--out", str(tmp_path), "--target", "t", "--methods", "none"])
    assert not any(label.startswith("draft-cost") for label, _, _ in measurements(build_setup(args), SUITES, args))
