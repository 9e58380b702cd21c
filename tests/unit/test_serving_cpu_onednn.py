"""vLLM's CPU oneDNN handles, freed while torch.compile traces (docs/known-issues.md, "the worker
dies of a stack overflow at warm-up"): vLLM's own finaliser fails there, the plugin's does not."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# In a fresh process: a real oneDNN matmul handle (and one recorded on the meta device, as the
# engine's recompile after a failed AOT load leaves them) dropped while a fake-tensor trace is
# active, the way the garbage collector drops them during torch.compile. What each finaliser
# leaves to sys.unraisablehook, first vLLM's own, then the plugin's.
FINALISERS = """
import json, sys, torch, vllm_edsd
from torch._dispatch.python import enable_python_dispatcher
from torch._subclasses.fake_tensor import FakeTensorMode
from vllm import _custom_ops as ops

def dropped_while_tracing(make):
    held, raised = [make()], []  # the only reference, so that clearing it runs the finaliser
    sys.unraisablehook = lambda report: raised.append(type(report.exc_value).__name__)
    with FakeTensorMode(allow_non_fake_inputs=True), enable_python_dispatcher():
        held.clear()
    sys.unraisablehook = sys.__unraisablehook__
    return raised

def meta_handler():
    handler = ops.CPUDNNLGEMMHandler()
    handler.handler_tensor = torch.tensor(0, dtype=torch.int64, device="meta")
    return handler

HANDLERS = {"real": lambda: ops.create_onednn_mm(torch.randn(64, 32).t()), "meta": meta_handler}
result = {"vllm": {name: dropped_while_tracing(make) for name, make in HANDLERS.items()}}
vllm_edsd.register()
result["plugin"] = {name: dropped_while_tracing(make) for name, make in HANDLERS.items()}
print(json.dumps(result))
"""


@pytest.mark.vllm_range
def test_handles_dropped_while_tracing_are_freed_without_error():
    out = subprocess.run([sys.executable, "-c", FINALISERS], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["vllm"]["real"] and result["vllm"]["meta"], result  # what the plugin's row is for
    assert result["plugin"] == {"real": [], "meta": []}, result
