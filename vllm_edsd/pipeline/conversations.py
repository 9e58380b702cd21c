"""The pipeline's ``data`` stage: single-turn prompts sampled from ShareGPT (chat and code
requests, seeded, held-out prompts left out), and the JSON lines file the later stages read."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path

from vllm_edsd.checkpoint.files import replace_file
from vllm_edsd.errors import EDSDError

PROMPT_CHARS = 600  # ShareGPT prompts are cut: training cost grows with every token of context
CODE_REQUEST = re.compile(r"\b(python|javascript|typescript|java|c\+\+|rust|golang|sql|function|code|script|"
                          r"class|regex|bash|html|css|program)\b", re.IGNORECASE)


def drafter_prompts(chat: int, code: int, seed: int, exclude: Iterable[str] = ()) -> list[list[dict]]:
    """``chat`` + ``code`` single-turn prompts: distinct first user turns of ShareGPT in a seeded
    order, none of them in ``exclude`` (held-out prompts); a prompt is "code" when it names a
    language or code. They stay in that order, chat and code mixed, so a larger request extends a
    smaller one (its regenerated chunks are reused) and any prefix is a sample of both kinds."""
    from vllm_edsd.data import load_sharegpt

    held_out = set(exclude)
    wanted, counts = {"chat": chat, "code": code}, {"chat": 0, "code": 0}
    picked: list[str] = []
    seen: set[str] = set()
    for conv in load_sharegpt(None, seed):
        first = next((m["content"].strip() for m in conv if m["role"] == "user"), "")[:PROMPT_CHARS]
        if len(first) < 16 or first in seen or first in held_out:
            continue
        kind = "code" if CODE_REQUEST.search(first) else "chat"
        if counts[kind] < wanted[kind]:
            picked.append(first)
            seen.add(first)
            counts[kind] += 1
        if counts == wanted:
            break
    if counts != wanted:
        raise EDSDError(f"ShareGPT gave {counts['chat']} chat and {counts['code']} code prompts here; "
                        f"{chat} and {code} requested")
    return [[{"role": "user", "content": text}] for text in picked]


def write_conversations(path: Path, conversations: list) -> None:
    """JSON lines of ``{"messages": [...]}``, written whole or not at all."""
    replace_file(path, lambda tmp: tmp.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations)))
