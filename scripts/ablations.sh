#!/usr/bin/env bash
# Ablations at 2,048 conversations (docs/paper.md): one learning-curve point per row, same data,
# order, seeds and optimizer steps. Hours on a CPU. Every stage resumes where it stopped: rerun
# the script. Rows already in results.json are kept.
#   bash scripts/ablations.sh                  the recipe's rows (docs/paper.md, "Ablations at 2,048 conversations")
#   bash scripts/ablations.sh 2                their first two rows only
#   SET=draft-layer bash scripts/ablations.sh  the draft layer's rows ("The draft layer's attention input")
#   SET=eagle31 bash scripts/ablations.sh      EAGLE 3.1 and EDSD's fc norms (#75): the first 2,048 of the
#                                              draft-layer-10k answers, the shipped recipes and layers
#   SET=eagle31-10k bash scripts/ablations.sh  #75's final pair on all 10,043 conversations, in bfloat16
#                                              autocast: EDSD with $EDSD_SWITCHES, EAGLE with $EAGLE_SWITCHES
#                                              (defaults: the 2,048 rows' best; about 2 h of extraction and
#                                              2 h per row on a 2-core CPU; resumes)
#   SET=draft-layer-10k bash scripts/ablations.sh  the 2k winner (token-reading + feature norm) against EAGLE-3 on all
#                                              10,043 conversations (days on a 2-core CPU; resumes;
#                                              on a GPU without vLLM: scripts/draft_layer_10k_gpu.sh)
# Environment: ROW=i runs row i alone (from 0); TRAIN_EXTRA adds `edsd train` flags to every row
# (a shared budget, e.g. a GPU's larger batch); DEVICE is where the drafters train (default cpu);
# PYTHON is the interpreter (default .venv/bin/python, set up if needed); WORK the learning curve's
# --work; TRAIN_ONLY=1 trains and measures nothing (a machine without vLLM); CONVERSATIONS=N makes
# the draft-layer-10k set a trial on N chat prompts.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if [ -z "${PYTHON:-}" ]; then
  PYTHON=.venv/bin/python
  $PYTHON -c "import vllm, vllm_edsd" 2>/dev/null || bash scripts/setup.sh >/dev/null  # set up if needed
fi
# Batch stages on a CPU: vLLM's KV cache is a fraction of the NUMA node; 0.25 holds 4 sequences of
# the demo target on a 10-GiB node, 0.6 about 50 (4.5x the regeneration throughput, measured).
export EDSD_CPU_MEMORY_FRACTION=${EDSD_CPU_MEMORY_FRACTION:-0.6}
COSINE="--lr-schedule cosine --weight-decay 0"
DATA=(--sizes 2048)
if [ "${SET:-recipe}" = eagle31 ]; then
  # The shipped pair's recipe against EAGLE 3.1 (speculators' defaults) and a norm before EDSD's fc,
  # on the first 2,048 of the 10,043 answers the draft-layer-10k set trains on (seeded, not answered again).
  OUT=${OUT:-bench/results/learning-curve-eagle31-2k-avx512}
  DATA=(--chat-prompts 8070 --code-prompts 1973 --sizes 2048)
  LAYERS=1,20,29
  $PYTHON -m bench.gpu_runs seed --work "${WORK:-$HOME/.cache/vllm-edsd/learning-curve}"
  # Every row but the first trains its loss's forward in bfloat16 (1.76x the positions per second
  # on an AVX512-BF16 CPU); the first two rows are the same EAGLE-3 in float32 and in bfloat16.
  SHIPPED_EDSD="--attention-reads-token --feature-norm"
  BF16="--autocast bfloat16"
  ROWS=(
    "eagle3|"                                                             # EAGLE-3 as shipped, float32
    "eagle3|$BF16"                                                        # the same in bfloat16: what it costs
    "edsd|$SHIPPED_EDSD $BF16"                                            # EDSD as shipped
    "eagle3|--norm-before-fc --norm-before-residual --norm-output $BF16"  # EAGLE 3.1, speculators' defaults
    "edsd|$SHIPPED_EDSD --fuse-intermediate-size 576 $BF16"               # EDFuse at the target's width: 1.3 ms
                                                                          # less a decode step (docs/results.md)
    "edsd|$SHIPPED_EDSD --fuse-intermediate-size 576 --norm-before-fc --norm-before-residual $BF16"
                                                                          # and EAGLE 3.1's norms of fc's input and of
                                                                          # the residual (EDSD's own for its output)
    "edsd|$SHIPPED_EDSD --fuse-intermediate-size 576 --norm-before-fc --norm-before-residual --no-step-n $BF16"
                                                                          # the same with every TTT step from the first
                                                                          # epoch, as EAGLE-3 trains (no Step-n)
    "edsd|$SHIPPED_EDSD --fuse-intermediate-size 576 --norm-before-fc --norm-before-residual --fuse-residual $BF16"
                                                                          # and EDFuse's residual: the fed-back state
                                                                          # passes the gate, as EAGLE's reaches its layer
    "edsd|$SHIPPED_EDSD --fuse-residual $BF16"                            # EDFuse's residual alone on EDSD as shipped
    "edsd|$SHIPPED_EDSD --norm-before-fc $BF16"                           # one RMSNorm over [layer a; layer b]
    "eagle3|--fc-norm --norm-before-residual --norm-output $BF16"         # EAGLE 3.1 with the per-layer norm
    "edsd|$SHIPPED_EDSD --fc-norm $BF16"                                  # a norm per target layer before fc
    "edsd|$SHIPPED_EDSD --fuse-intermediate-size 576 --fc-norm --norm-before-residual --fuse-residual $BF16"
                                                                          # the best row with fc's norm per layer,
                                                                          # as EAGLE 3.1 gained from it
  )
elif [ "${SET:-recipe}" = eagle31-10k ]; then
  # The best EAGLE and the best EDSD of the eagle31 rows (both with fc_norm), on every answer of the
  # draft-layer-10k set.
  OUT=${OUT:-bench/results/learning-curve-eagle31-10k-avx512}
  DATA=(--chat-prompts 8070 --code-prompts 1973 --sizes 10043)
  LAYERS=1,20,29
  $PYTHON -m bench.gpu_runs seed --work "${WORK:-$HOME/.cache/vllm-edsd/learning-curve}"
  # (the first EDSD row here had --norm-before-fc: tau 2.029; its row stays in the report)
  ROWS=(
    "eagle3|${EAGLE_SWITCHES:---fc-norm --norm-before-residual --norm-output} --autocast bfloat16"
    "edsd|${EDSD_SWITCHES:---attention-reads-token --feature-norm --fuse-intermediate-size 576 --fc-norm --norm-before-residual --fuse-residual} --autocast bfloat16"
  )
elif [ "${SET:-recipe}" = draft-layer-10k ]; then
  # Every usable ShareGPT conversation of the PyPI wheel (learning-curve-10k's data), the demo recipe.
  OUT=${OUT:-bench/results/learning-curve-draft-layer-10k-avx2}
  DATA=(--chat-prompts 8070 --code-prompts 1973 --sizes 10043)
  [ -n "${CONVERSATIONS:-}" ] && DATA=(--chat-prompts "$CONVERSATIONS" --code-prompts 0 --sizes "$CONVERSATIONS")  # a trial
  LAYERS=1,20,29
  # the target's answers and EDSelect's layers from a GPU run (its report), not answered again
  [ -z "${CONVERSATIONS:-}" ] && $PYTHON -m bench.gpu_runs seed --work "${WORK:-$HOME/.cache/vllm-edsd/learning-curve}"
  ROWS=(
    "edsd|--attention-reads-token --feature-norm"         # the 2,048-conversation winner (docs/paper.md)
    "eagle3|"                                             # EAGLE-3, the same recipe, data, order and steps
    "edsd|"                                               # the paper's draft layer
  )
elif [ "${SET:-recipe}" = draft-layer ]; then
  # The demo recipe (vllm_edsd/demo/pipeline.toml) with one change of EDSD's draft layer per row.
  OUT=${OUT:-bench/results/learning-curve-draft-layer-2k-avx512}
  LAYERS=1,20,29  # the recipe rows' extraction (a superset of these rows' layers): one feature cache for both sets
  ROWS=(
    "edsd|"                                               # the paper's draft layer
    "edsd|--attention-reads-token"                        # q/k/v read [input_layernorm(u); token_norm(e)]
    "eagle3|"                                             # EAGLE-3, the same recipe
    "edsd|--attention-reads-token --feature-norm"         # both
    "edsd|--feature-norm"                                 # EDFuse's gate on RMSNorm(g)
    "edsd|--no-step-n"                                    # every TTT step from the first epoch
  )
else
  OUT=${OUT:-bench/results/learning-curve-ablation-2k-avx2}
  LAYERS=1,20,29  # besides EDSelect's and EAGLE-3's (2, 15, 27): every row's layers, one extraction
  ROWS=(
    "edsd|$COSINE"                              # the paper's recipe: EDSelect's layers, annealed
    "eagle3|$COSINE"                            # EAGLE-3 with the same optimizer
    "edsd|--layers 1,20"                        # the shipped recipe and layers
    "eagle3|"                                   # the shipped EAGLE-3 recipe
    "edsd|$COSINE --no-step-n"                  # every TTT step from the first epoch
    "edsd|$COSINE --ttt-steps 7"                # the paper's S_max = 7 over the epochs run: n_t = 1, 4, 7
    "edsd|$COSINE --token-norm layernorm"       # the paper's LayerNorm on the token stream
    "edsd|$COSINE --no-mask-p"                  # no entropy mask (the paper's Mask-p off)
    "edsd|$COSINE --fuse-intermediate-size 576" # EDFuse at the target's width (the paper's no-extra-parameters one)
    "edsd|$COSINE --layers 15,27"               # EAGLE-3's middle and top layers, EDSD's fusion
    "edsd|--lr 5e-4 $COSINE"
    "eagle3|--lr 5e-4 $COSINE"
    "edsd|"                                     # EDSelect's layers, the shipped optimizer
  )
fi
count=${1:-${#ROWS[@]}}
chosen=("${ROWS[@]:0:$count}")
[ -n "${ROW:-}" ] && chosen=("${ROWS[$ROW]}")
for row in "${chosen[@]}"; do
  method=${row%%|*} extra=$(echo ${row#*|} ${TRAIN_EXTRA:-})
  echo "== $method ${extra:-(the demo recipe)}  ($(date -u +%H:%M))"
  $PYTHON -m bench learning-curve "${DATA[@]}" --out "$OUT" ${LAYERS:+--feature-layers "$LAYERS"} \
    --methods "$method" --train-extra="$extra" --device "${DEVICE:-cpu}" ${WORK:+--work "$WORK"} ${TRAIN_ONLY:+--train-only}
done
