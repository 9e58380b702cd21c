"""``edsd convert``: arguments, progress bar and the summary."""

from __future__ import annotations

import argparse

from vllm_edsd.checkpoint.files import SUPPORTED_DTYPES
from vllm_edsd.checkpoint.target import LAYER_ID_CONVENTIONS
from vllm_edsd.command import defaults, options_from, stage_run
from vllm_edsd.methods.edsd.config import DEFAULT_SPECULATIVE_TOKENS, MAX_SPECULATIVE_TOKENS

from .stage import ConvertOptions
from .stage import run as convert

EPILOG = """\
SRC is an EDSD drafter as training wrote it, recognised by its architecture name or its
tensor names:
  - this project's training layout (`edsd train`): LlamaForCausalLMEDSD
  - SpecForge's EdsdDraftModel: target_layer_ids are read as "output of layer i" (vLLM id
    i+1), embnorm is the RMSNorm token norm; SRC may be an epoch_*_step_* save or the
    directory holding them (the latest is taken). training_state.pt is never opened.
Weights: model.safetensors, sharded safetensors with model.safetensors.index.json, or a
legacy pytorch_model.bin (read without unpickling code). DST is written atomically: a
failed conversion leaves nothing behind.
DST's config.json is also in the speculators format when the target is known (--verifier, or
--target): `vllm serve DST` then loads that target and drafts with DST (docs/formats.md).

examples:
  edsd convert runs/edsd/final drafters/edsd-llama
  edsd convert outputs/qwen3-8b-edsd drafters/qwen3-edsd --target /models/Qwen3-8B --dtype bfloat16
  edsd convert ckpt out --target /models/Llama-3.1-8B-Instruct --fold-token-norm
  edsd convert ckpt out --target /models/Llama-3.1-8B-Instruct --verifier meta-llama/Llama-3.1-8B-Instruct
"""


# The `edsd convert` subcommand (vllm_edsd.command).
name = "convert"
help = "convert an EDSD drafter (this project's training layout or SpecForge's) to the layout vLLM serves"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    parser.add_argument("src", help="EDSD drafter directory (this project's training layout or SpecForge's)")
    parser.add_argument("dst", help="output directory (vLLM layout)")
    parser.add_argument("--dtype", choices=SUPPORTED_DTYPES, help="weight dtype of the output (default: the source's)")
    parser.add_argument(
        "--target", help="target model directory: check the drafter against it and record its fingerprint"
    )
    parser.add_argument("--fold-token-norm", action="store_true",
                        help="fold EDFuse's token norm (RMSNorm or LayerNorm) into a draft-owned embedding "
                             "table made from --target's: one norm less per draft step, one table more in memory")
    parser.add_argument("--layer-id-convention", choices=LAYER_ID_CONVENTIONS,
                        help="how SRC numbers its aux layers, overriding what its layout says: layer_input = "
                             "vLLM/EAGLE, layer_output = SpecForge (output of layer i = vLLM id i+1)")
    parser.add_argument("--verifier", metavar="NAME_OR_PATH",
                        help="the target vLLM loads when DST is served alone (`vllm serve DST`): a directory or "
                             "a model hub id (default: --target, made absolute; without either DST is served "
                             "only with --speculative-config)")
    parser.add_argument("--num-speculative-tokens", type=int, metavar="K",
                        help=f"draft length K when DST is served alone, 1..{MAX_SPECULATIVE_TOKENS} "
                             f"(default: {DEFAULT_SPECULATIVE_TOKENS})")
    parser.add_argument("--force", action="store_true", help="replace DST if it exists")
    parser.set_defaults(**defaults(ConvertOptions))


def options(args: argparse.Namespace) -> ConvertOptions:
    """The parsed arguments as the stage's options."""
    return options_from(ConvertOptions, args)


run = stage_run(options, convert)
