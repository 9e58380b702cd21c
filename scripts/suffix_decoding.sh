#!/usr/bin/env bash
# vLLM's "suffix" method needs ArcticInference's suffix trees (arctic_inference.suffix_decoding).
# PyPI has only its 0.3.0 source, whose build pulls a CUDA torch and builds CUDA ops; this builds
# the one CPU extension vLLM imports (the suffix tree, C++ through nanobind) into
# ~/.cache/vllm-edsd/arctic-site, without ArcticInference's own vLLM plugin. Then:
#   PYTHONPATH=$PWD:$HOME/.cache/vllm-edsd/arctic-site python -m bench acceptance --methods none,ngram,suffix ...
set -euo pipefail
cd "$(dirname "$0")/.."
SITE=${SITE:-$HOME/.cache/vllm-edsd/arctic-site}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
command -v cmake >/dev/null && command -v g++ >/dev/null || { echo "needs cmake and g++" >&2; exit 2; }
.venv/bin/pip download --no-deps arctic-inference==0.3.0 -d "$WORK" -q  # the sdist, not built
tar xzf "$WORK"/arctic_inference-0.3.0.tar.gz -C "$WORK"
SRC=$WORK/arctic_inference-0.3.0
BASE=$(.venv/bin/python -c "import sys; print(sys.base_prefix)")/bin/python3
"$BASE" -m venv "$WORK/venv" && "$WORK/venv/bin/pip" install -q nanobind==2.9.2
cmake -S "$SRC/csrc/suffix_decoding" -B "$WORK/build" -DPython_EXECUTABLE="$WORK/venv/bin/python" \
  -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$WORK/build" -j"$(nproc)" >/dev/null
rm -rf "$SITE" && mkdir -p "$SITE"
cp -r "$SRC/arctic_inference" "$SITE/"
cp "$WORK"/build/_C.*.so "$SITE/arctic_inference/suffix_decoding/"
PYTHONPATH=$SITE .venv/bin/python -c "from arctic_inference.suffix_decoding import SuffixDecodingCache as C; C(24, 10)"
echo "built $SITE (add it to PYTHONPATH for vLLM's suffix method)"
