#!/usr/bin/env bash
# The GPU tier (tests marked `gpu`: CUDA graphs, Model Runner V2 and V1, CUDA's rejection
# sampler) on a CUDA machine, in the current Python environment: installs this package with
# vLLM's CUDA build (the `cuda` extra) and the test extra, then runs the tier. Elsewhere these
# tests are skipped. PYTHON picks the interpreter (default: python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "test_gpu: torch sees no CUDA GPU in $PY; run this on a CUDA machine" >&2
  exit 2
fi
"$PY" -m pip install -q -e ".[cuda,test]"
"$PY" -m pytest -m gpu tests/engine -rs "$@"
