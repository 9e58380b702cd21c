"""Regeneration through transformers (no vLLM needed): batched, left-padded greedy answers are
the ones the target gives each prompt alone, chunks are cached and resumed, and conversations
stay in order and whole across turns."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from support.toy import make_target, toy_corpus

from vllm_edsd.errors import EDSDError
from vllm_edsd.regeneration import answers
from vllm_edsd.regeneration.greedy import greedy_answers, greedy_replies, length_batches


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    return str(make_target(tmp_path_factory.mktemp("regeneration") / "target", seed=5, train_steps=60))


@pytest.fixture(scope="module")
def model_and_tokenizer(target):
    from transformers import AutoTokenizer

    from vllm_edsd.launch.transformers_target import load_target

    return load_target(target), AutoTokenizer.from_pretrained(target)


def chats(count: int, offset: int = 0) -> list[list[dict]]:
    lines = [line for line in toy_corpus().splitlines() if line.strip()][offset : offset + count]
    return [[{"role": "user", "content": " ".join([line] * (1 + i % 3))}] for i, line in enumerate(lines)]


def test_batches_stay_within_the_token_budget_and_cover_every_prompt():
    lengths = [5, 40, 12, 40, 3, 300, 8]
    batches = length_batches(lengths, max_tokens=16, token_budget=128)
    assert sorted(i for batch in batches for i in batch) == list(range(len(lengths)))
    for batch in batches:
        longest = max(lengths[i] for i in batch)
        assert lengths[batch[0]] == longest
        assert len(batch) == 1 or len(batch) * (longest + 16) <= 128


def test_batched_answers_equal_each_prompt_answered_alone(model_and_tokenizer):
    """Left padding, the attention mask and the end token do not change an answer."""
    from transformers import GenerationConfig

    from vllm_edsd.data import template_ids

    model, tokenizer = model_and_tokenizer
    prompts = chats(7)
    batched = greedy_replies(model, tokenizer, prompts, 12, token_budget=160)  # several batches of mixed lengths
    plain = GenerationConfig(max_new_tokens=12, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id)
    for chat, reply in zip(prompts, batched):
        ids = torch.tensor([template_ids(tokenizer, chat, generation_prompt=True)])
        alone = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=plain)[0]
        answer = alone[ids.shape[1]:].tolist()
        if tokenizer.eos_token_id in answer:
            answer = answer[: answer.index(tokenizer.eos_token_id)]
        assert reply == tokenizer.decode(answer, skip_special_tokens=True)
    assert any(batched)


def test_answers_stop_where_the_batch_reaches_the_targets_context(model_and_tokenizer):
    """With the target's context (``window``) three tokens past the longest prompt, every answer
    of the batch is the start of its unbounded answer and no longer than three tokens, where the
    unbounded ones run on."""
    from vllm_edsd.data import template_ids

    model, tokenizer = model_and_tokenizer
    prompts = [template_ids(tokenizer, chat, generation_prompt=True) for chat in chats(4)]
    window = max(map(len, prompts)) + 3
    free = greedy_answers(model, tokenizer, prompts, 24, token_budget=1 << 14)
    capped = greedy_answers(model, tokenizer, prompts, 24, token_budget=1 << 14, window=window)
    assert all(whole.startswith(start) for whole, start in zip(free, capped))
    assert all(len(tokenizer(start, add_special_tokens=False).input_ids) <= 3 for start in capped)
    assert any(len(whole) > len(start) for whole, start in zip(free, capped))


def test_regeneration_through_transformers_is_cached_and_resumed(target, tmp_path, monkeypatch):
    monkeypatch.setattr(answers, "REGENERATE_CHUNK", 2)
    monkeypatch.setitem(answers.CHUNKS_PER_CALL, "transformers", 2)
    convs = chats(5, offset=10)
    convs[1] = [{"role": "system", "content": "be brief"}, *convs[1], {"role": "assistant", "content": "old"},
                {"role": "user", "content": "and then?"}]
    first = answers.regenerate(target, convs[:3], tmp_path, 6, backend="transformers", device="cpu")
    written = {p.name: p.stat().st_mtime_ns for p in tmp_path.glob("regenerated-*.jsonl")}
    assert len(written) == 2
    every = answers.regenerate(target, convs, tmp_path, 6, backend="transformers", device="cpu")
    assert every[:3] == first and len(every) == 5
    assert all(written[name] == (tmp_path / name).stat().st_mtime_ns for name in written)
    # the second conversation keeps its system turn, and each user turn gets the target's reply
    roles = [m["role"] for m in every[1]]
    assert roles == ["system", "user", "assistant", "user", "assistant"]
    assert every[1][2]["content"] != "old"
    assert [c[0]["content"] for c in every if c[0]["role"] == "user"] == [c[0]["content"] for c in convs
                                                                          if c[0]["role"] == "user"]
    chunk = json.loads(next(tmp_path.glob("regenerated-*.jsonl")).read_text().splitlines()[0])
    assert chunk[-1]["role"] == "assistant"


def test_the_cache_key_follows_the_weights_and_chat_template_in_the_same_directory(target, tmp_path):
    """Retrained weights (or a new chat template) at the same path answer differently: their
    chunks get new keys, while an untouched target keeps its own."""
    copy = Path(shutil.copytree(target, tmp_path / "target"))
    chunks = [chats(2), chats(2, offset=2)]
    first = answers.regenerated_paths(str(copy), chunks, tmp_path / "cache", 6)
    assert len(set(first)) == 2 and answers.regenerated_paths(str(copy), chunks, tmp_path / "cache", 6) == first
    weights = load_file(copy / "model.safetensors")
    save_file({name: tensor + 1e-3 for name, tensor in weights.items()}, copy / "model.safetensors")  # "retrained"
    retrained = answers.regenerated_paths(str(copy), chunks, tmp_path / "cache", 6)
    assert not set(retrained) & set(first)
    assert answers.regenerated_paths(str(copy), chunks, tmp_path / "cache", 6) == retrained
    template = next(copy / name for name in ("chat_template.jinja", "tokenizer_config.json") if (copy / name).is_file())
    template.write_text(template.read_text().replace("<|end|>", "<|end|>\n"))
    assert not set(answers.regenerated_paths(str(copy), chunks, tmp_path / "cache", 6)) & {*first, *retrained}


def test_the_cache_key_follows_the_engines_context(target, tmp_path):
    """An engine given a shorter ``max_model_len`` skips other turns and stops answers earlier:
    its chunks get their own keys; the engine's default context keeps the target's keys."""
    chunks = [chats(2)]
    default = answers.regenerated_paths(target, chunks, tmp_path, 6)
    shorter = answers.regenerated_paths(target, chunks, tmp_path, 6, max_model_len=64)
    assert shorter != default and answers.regenerated_paths(target, chunks, tmp_path, 6, None) == default
    assert answers.regenerated_paths(target, chunks, tmp_path, 6, max_model_len=128) not in (default, shorter)


def test_engine_arguments_need_vllm():
    with pytest.raises(EDSDError, match="through transformers"):
        answers.generation_backend("transformers", {"tensor_parallel_size": 2})
    with pytest.raises(EDSDError, match="unknown regeneration backend"):
        answers.generation_backend("sglang")


def test_a_target_without_a_chat_template_is_refused_in_one_line(tmp_path, capsys):
    """A base model (no chat template) cannot answer chats: `edsd regenerate` says what to do
    in one line before any work, not transformers' traceback, and writes nothing."""
    from vllm_edsd.cli import main

    base = make_target(tmp_path / "base", chat_template=False)
    data, out = tmp_path / "chats.jsonl", tmp_path / "answers.jsonl"
    data.write_text("".join(json.dumps({"messages": chat}) + "\n" for chat in chats(3)))
    capsys.readouterr()  # building the target logs its own progress
    assert main(["regenerate", str(base), "--out", str(out), "--data", str(data), "--answer-tokens", "4",
                 "--backend", "transformers", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1
    assert err.startswith(f"edsd regenerate: error: {base}: its tokenizer has no chat template (a base model?)")
    assert "give it one" in err and "--data" in err
    assert not out.exists() and not (tmp_path / "regenerate-cache").exists()

