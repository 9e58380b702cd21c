"""``edsd convert``: arguments, progress bar and the summary."""

from __future__ import annotations

import argparse
import sys

from vllm_edsd.config import LAYER_ID_CONVENTIONS, SUPPORTED_DTYPES

from .converter import convert

EPILOG = """\
SRC is a drafter in the EDSD training layout (config.json + model.safetensors, sharded
safetensors with model.safetensors.index.json, or a legacy pytorch_model.bin). DST is
written atomically: a failed conversion leaves nothing behind.

examples:
  edsd convert runs/edsd/final drafters/edsd-llama
  edsd convert ckpt out --target /models/Llama-3.1-8B-Instruct --dtype bfloat16
  edsd convert specforge_ckpt out --layer-id-convention layer_output   # SpecForge ids: +1
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    parser.add_argument("src", help="drafter directory in the EDSD training layout")
    parser.add_argument("dst", help="output directory (vLLM layout)")
    parser.add_argument("--dtype", choices=SUPPORTED_DTYPES, help="weight dtype of the output (default: the source's)")
    parser.add_argument("--target", help="target model directory: check the drafter against it and record its fingerprint")
    parser.add_argument("--fold-token-norm", action="store_true",
                        help="fold EDFuse's LayerNorm into a draft-owned embedding table taken from --target")
    parser.add_argument("--layer-id-convention", choices=LAYER_ID_CONVENTIONS,
                        help="how SRC numbers its aux layers (overrides config.json): layer_input = vLLM/EAGLE, "
                             "layer_output = SpecForge (output of layer i = vLLM id i+1)")
    parser.add_argument("--force", action="store_true", help="replace DST if it exists")


def run(args: argparse.Namespace) -> int:
    def progress(items, total):
        if not sys.stderr.isatty():
            return items
        from tqdm import tqdm

        return tqdm(items, total=total, desc="converting", unit="tensor")

    summary = convert(
        args.src, args.dst, dtype=args.dtype, target=args.target, fold_token_norm=args.fold_token_norm,
        layer_id_convention=args.layer_id_convention, force=args.force, progress=progress,
    )
    print(summary.render())
    return 0
