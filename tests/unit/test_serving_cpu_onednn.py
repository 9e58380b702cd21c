"""vLLM's CPU oneDNN handles, freed while torch.compile traces (docs/known-issues.md, "the worker
dies of a stack overflow at warm-up"): vLLM's own finaliser fails there, the plugin's does not."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# In a fresh process: a real oneDNN matmul handle, one recorded on the meta device (as the
# engine's recompile after a failed AOT load leaves them) and one made under a fake-tensor trace
# (as torch.compile's tracing of a linear layer leaves them), each dropped while a fake-tensor
# trace is active, inside a fake-tensor kernel (every operation sent to the meta kernels) and
# outside both, the ways the garbage collector drops them. What each
# finaliser leaves to sys.unraisablehook, first vLLM's own, then the plugin's, and the plugin's
# count of freed and skipped handles.
FINALISERS = """
import contextlib, json, sys, torch, vllm_edsd
from torch._dispatch.python import enable_python_dispatcher
from torch._subclasses.fake_tensor import FakeTensorMode, in_kernel_invocation_manager
from vllm import _custom_ops as ops

def tracing():
    stack = contextlib.ExitStack()
    stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
    stack.enter_context(enable_python_dispatcher())
    return stack

def dropped(make, during):
    held, raised = [make()], []  # the only reference, so that clearing it runs the finaliser
    sys.unraisablehook = lambda report: raised.append(type(report.exc_value).__name__)
    with during():
        held.clear()
    sys.unraisablehook = sys.__unraisablehook__
    return raised

def handler_holding(make_tensor):
    handler = ops.CPUDNNLGEMMHandler()
    handler.handler_tensor = make_tensor()
    return handler

def fake_tensor():
    with FakeTensorMode():
        return torch.tensor(0, dtype=torch.int64)

HANDLERS = {"real": lambda: ops.create_onednn_mm(torch.randn(64, 32).t()),
            "meta": lambda: handler_holding(lambda: torch.tensor(0, dtype=torch.int64, device="meta")),
            "fake": lambda: handler_holding(fake_tensor)}
def in_fake_kernel():
    return in_kernel_invocation_manager(FakeTensorMode())

WHEN = {"tracing": tracing, "in kernel": in_fake_kernel, "after": contextlib.nullcontext}

def every_drop():
    return {f"{name} {when}": dropped(make, during) for name, make in HANDLERS.items() for when, during in WHEN.items()}

result = {"vllm": every_drop()}
vllm_edsd.register()
from vllm_edsd.serving.repairs.cpu_onednn import RELEASES
result["plugin"] = every_drop()
result["releases"] = dict(RELEASES)
print(json.dumps(result))
"""


@pytest.mark.vllm_range
def test_handles_dropped_while_tracing_are_freed_without_error():
    out = subprocess.run([sys.executable, "-c", FINALISERS], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    # what the plugin's row is for: vLLM's finaliser fails on a real handle while tracing, and on
    # the meta ones wherever they are dropped, on the fake ones while tracing
    failing = ("real tracing", "real in kernel", "meta tracing", "meta after", "fake tracing")
    assert all(result["vllm"][drop] for drop in failing), result
    assert not any(result["plugin"].values()), result
    assert result["releases"] == {"freed": 3, "skipped": 6}, result  # the three real handles freed, no other
