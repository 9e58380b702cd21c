#!/usr/bin/env bash
# Set up (if needed) and run the main job: serve the demo target with its EDSD drafter.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/edsd demo "$@"
