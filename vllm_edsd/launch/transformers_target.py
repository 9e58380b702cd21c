"""The target as a transformers model, for the work that runs it outside vLLM: regeneration
and features where vLLM is not installed, EDSelect, and the drafter's initialisation."""

from __future__ import annotations

from pathlib import Path

import torch

from vllm_edsd.errors import EDSDError


def load_target(path: str | Path, *, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """A transformers causal LM from a local directory (no hub access)."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if not (path / "config.json").is_file():
        raise EDSDError(f"{path}: not a model directory (no config.json)")
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True)
    return model.to(device).eval()


def device_dtype(device: str) -> str:
    """The target's dtype where none is asked for: float32 on a CPU, bfloat16 on an accelerator."""
    return "float32" if device == "cpu" else "bfloat16"


def default_device(device: str | None = None) -> str:
    """``device``, or where none is given the GPU where there is one, else the CPU."""
    return device or ("cuda" if torch.cuda.is_available() else "cpu")
