"""The machine block every results file carries: processor, instruction set, cores, load,
the versions of vLLM, torch and this package, and the day the run started (UTC), which
``python -m bench index`` lists."""

from __future__ import annotations

import os
import platform
from datetime import datetime, timezone


def describe(machine: dict) -> str:
    """The machine block as a report's header says it: processor, CPU flags, cores, vLLM."""
    return (f"{machine['processor']} ({machine.get('cpu_instruction_set')}), {machine['cores']} cores, "
            f"vLLM {machine.get('vllm', '?')}")


def machine() -> dict:
    import torch
    import vllm

    import vllm_edsd
    from vllm_edsd.launch.engine import cpu_instruction_set
    from vllm_edsd.launch.server import default_dtype

    accelerator = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none (CPU)"
    processor = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                processor = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"processor": processor, "cpu_instruction_set": cpu_instruction_set(), "cores": os.cpu_count(),
            "accelerator": accelerator, "default_dtype": default_dtype(),
            "load_average": [round(load, 2) for load in os.getloadavg()],  # other jobs on the machine
            "vllm": vllm.__version__, "torch": torch.__version__, "vllm_edsd": vllm_edsd.__version__,
            "python": platform.python_version(), "date": datetime.now(timezone.utc).strftime("%Y-%m-%d")}
