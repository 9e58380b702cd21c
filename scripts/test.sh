#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite: real vLLM engines and servers on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest tests "$@"
