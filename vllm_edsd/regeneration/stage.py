"""``edsd regenerate`` as a call: ``RegenerateOptions`` (the command's flags, with its defaults)
and ``run``, which the command and the pipeline both call."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from vllm_edsd.checkpoint.files import replace_file
from vllm_edsd.command import POSITIONAL
from vllm_edsd.data import read_conversations
from vllm_edsd.errors import positive_int

from .answers import regenerate


@dataclass(frozen=True, kw_only=True)
class RegenerateOptions:
    """What the target answers, how, and where the answers go."""

    target: str = field(metadata={POSITIONAL: True})  # a transformers directory
    out: str  # JSON lines of the answered conversations
    data: str | None = None  # conversations whose user turns are answered; None: ShareGPT
    max_samples: int | None = None  # conversations to answer; None: all
    seed: int = 0  # ShareGPT's order
    answer_tokens: int = 1024  # most tokens per answer
    cache: str | None = None  # answered chunks; None: OUT's directory/regenerate-cache
    backend: str = "auto"  # vLLM where installed (auto), or transformers
    device: str | None = None  # transformers' device; None: cuda if present, else cpu
    vllm_args: dict = field(default_factory=dict)  # vLLM's LLM(...) arguments


def run(options: RegenerateOptions) -> list:
    """The conversations answered by the target, also written to ``options.out`` (whole or not
    at all); answered chunks already in the cache are not generated again."""
    for flag in ("max_samples", "answer_tokens"):
        if getattr(options, flag) is not None:
            positive_int(getattr(options, flag), f"--{flag.replace('_', '-')}")
    out = Path(options.out)
    conversations = read_conversations(options.data, options.max_samples, options.seed)
    cache = Path(options.cache) if options.cache else out.parent / "regenerate-cache"
    answered = regenerate(options.target, conversations, cache, options.answer_tokens, options.vllm_args,
                          backend=options.backend, device=options.device)
    out.parent.mkdir(parents=True, exist_ok=True)
    replace_file(out, lambda tmp: tmp.write_text("".join(json.dumps({"messages": c}) + "\n" for c in answered)))
    print(f"regenerate: {len(answered)} of {len(conversations)} conversations answered by the target -> {out}")
    return answered
