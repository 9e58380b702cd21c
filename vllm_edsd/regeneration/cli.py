"""``edsd regenerate``: the target answers the training prompts itself, through vLLM's batched
generation (greedy, chat template applied), so that a drafter learns the target's own
distribution (docs/architecture.md, "Data flow"; docs/scale.md). Where vLLM is not installed,
transformers answers instead (``--backend``), on ``--device``.

Resumable: answers are cached in chunks under ``--cache``; a rerun generates only the chunks
not yet written. ``--vllm-args`` passes engine arguments (tensor parallelism...) to vLLM.
"""

from __future__ import annotations

import argparse

from vllm_edsd.command import add_stage_start, defaults, options_from, stage_run
from vllm_edsd.launch.engine import add_vllm_arguments

from .answers import GENERATION_BACKENDS
from .stage import RegenerateOptions
from .stage import run as regenerate

EPILOG = """\
examples:
  edsd regenerate TARGET --out answers.jsonl --max-samples 5000                # ShareGPT, seeded order
  edsd regenerate TARGET --out answers.jsonl --data prompts.jsonl --vllm-args '{"tensor_parallel_size": 8}'
  edsd regenerate TARGET --out answers.jsonl --backend transformers --device cuda  # no vLLM on this machine
then: edsd features / edsd train TARGET --data answers.jsonl ...
"""

# The `edsd regenerate` subcommand (vllm_edsd.command).
name = "regenerate"
help = "answer the training prompts with the target itself, through vLLM or transformers (resumable)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_stage_start(parser, __doc__, EPILOG)
    parser.add_argument("--out", required=True, help="JSON lines of the answered conversations ({'messages': [...]})")
    parser.add_argument("--data", help="JSON/JSONL conversations whose user turns are answered (default: ShareGPT)")
    parser.add_argument("--max-samples", type=int, help="conversations to answer (default all)")
    parser.add_argument("--seed", type=int, help="seed of ShareGPT's order (default %(default)s)")
    parser.add_argument("--answer-tokens", type=int, help="most tokens per answer (default %(default)s)")
    parser.add_argument("--cache", help="where answered chunks are kept (default: OUT's directory/regenerate-cache)")
    parser.add_argument("--backend", choices=GENERATION_BACKENDS,
                        help="what runs the target: vLLM where installed (auto), or transformers")
    parser.add_argument("--device", help="transformers' device (default: cuda if present, else cpu)")
    add_vllm_arguments(parser)
    parser.set_defaults(**defaults(RegenerateOptions))


def options(args: argparse.Namespace) -> RegenerateOptions:
    """The parsed arguments as the stage's options."""
    return options_from(RegenerateOptions, args)


run = stage_run(options, regenerate)
