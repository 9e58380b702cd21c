"""``edsd regenerate``: the target answers the training prompts itself, through vLLM's batched
generation (greedy, chat template applied), so that a drafter learns the target's own
distribution (docs/architecture.md, "Data flow"; docs/scale.md). Where vLLM is not installed,
transformers answers instead (``--backend``), on ``--device``.

Resumable: answers are cached in chunks under ``--cache``; a rerun generates only the chunks
not yet written. ``--vllm-args`` passes engine arguments (tensor parallelism...) to vLLM.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from vllm_edsd.checkpoint.files import replace_file
from vllm_edsd.data import read_conversations
from vllm_edsd.errors import positive_int
from vllm_edsd.launch.engine import add_vllm_arguments

from .answers import GENERATION_BACKENDS, regenerate

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
    parser.description = __doc__
    parser.epilog = EPILOG
    parser.add_argument("target", help="target model directory (transformers format)")
    parser.add_argument("--out", required=True, help="JSON lines of the answered conversations ({'messages': [...]})")
    parser.add_argument("--data", help="JSON/JSONL conversations whose user turns are answered (default: ShareGPT)")
    parser.add_argument("--max-samples", type=int, default=None, help="conversations to answer (default all)")
    parser.add_argument("--seed", type=int, default=0, help="seed of ShareGPT's order (default 0)")
    parser.add_argument("--answer-tokens", type=int, default=1024, help="most tokens per answer (default 1024)")
    parser.add_argument("--cache", help="where answered chunks are kept (default: OUT's directory/regenerate-cache)")
    parser.add_argument("--backend", choices=GENERATION_BACKENDS, default="auto",
                        help="what runs the target: vLLM where installed (auto), or transformers")
    parser.add_argument("--device", help="transformers' device (default: cuda if present, else cpu)")
    add_vllm_arguments(parser)


def run(args: argparse.Namespace) -> int:
    for flag in ("max_samples", "answer_tokens"):
        if getattr(args, flag) is not None:
            positive_int(getattr(args, flag), f"--{flag.replace('_', '-')}")
    out = Path(args.out)
    conversations = read_conversations(args)
    cache = Path(args.cache) if args.cache else out.parent / "regenerate-cache"
    answered = regenerate(args.target, conversations, cache, args.answer_tokens, args.vllm_args,
                          backend=args.backend, device=args.device)
    out.parent.mkdir(parents=True, exist_ok=True)
    replace_file(out, lambda tmp: tmp.write_text("".join(json.dumps({"messages": c}) + "\n" for c in answered)))
    print(f"regenerate: {len(answered)} of {len(conversations)} conversations answered by the target -> {out}")
    return 0
