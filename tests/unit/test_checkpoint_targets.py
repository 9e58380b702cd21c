"""Targets as they come: every stage's sequence length follows the target's context as vLLM
derives it, a length the target cannot hold is refused in one line before any work, samples and
prompts past it are cut or skipped and counted, and a target whose text settings are nested in
``text_config`` (a multimodal model) is read right wherever its config is read, by ``edsd
convert`` too. The whole flow on a short-context target, under torchrun, with vLLM's feature
extraction: ``tests/engine/test_serving_short_context.py``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from support.toy import make_drafter, make_target, toy_corpus

from vllm_edsd.checkpoint.target import context_length, decoder_layers, read_config_json, sequence_length
from vllm_edsd.cli import main
from vllm_edsd.errors import EDSDError
from vllm_edsd.methods.edsd.config import EDSDConfig
from vllm_edsd.methods.edsd.layouts import EDSD_TRAINING
from vllm_edsd.regeneration import answers

CONTEXT = 1024


@pytest.fixture(scope="module")
def short(tmp_path_factory) -> Path:
    """A toy Llama target whose context is 1,024 tokens."""
    return make_target(tmp_path_factory.mktemp("short") / "target", max_position_embeddings=CONTEXT)


@pytest.fixture(scope="module")
def nested(short, tmp_path_factory) -> Path:
    """A multimodal-style target: LLaVA with a one-layer CLIP tower, its language model the short
    target's (same weights, so the same fingerprint and embedding), its text settings under
    ``text_config``."""
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )

    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                              image_size=32, patch_size=16, projection_dim=32)
    text = AutoModelForCausalLM.from_pretrained(short)
    config = LlavaConfig(vision_config=vision, text_config=LlamaConfig.from_pretrained(short), image_token_index=6)
    model = LlavaForConditionalGeneration(config)
    model.model.language_model.load_state_dict(text.model.state_dict())
    model.lm_head.load_state_dict(text.lm_head.state_dict())
    out = tmp_path_factory.mktemp("nested") / "llava"
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(short).save_pretrained(out)
    return out


def variant(short: Path, root: Path, name: str, config=None, tokenizer=None) -> Path:
    """A copy of the short target with its config.json (and tokenizer_config.json) edited."""
    out = root / name
    shutil.copytree(short, out)
    for file, edit in (("config.json", config), ("tokenizer_config.json", tokenizer)):
        if edit:
            raw = json.loads((out / file).read_text())
            edit(raw)
            (out / file).write_text(json.dumps(raw))
    return out


# name -> (config.json edit, tokenizer_config.json edit, the context vLLM derives)
VARIANTS = {
    "max_position_embeddings": (None, None, CONTEXT),
    "linear RoPE x2": (lambda c: c.update(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}),
                       None, 2 * CONTEXT),
    "llama3 RoPE (already scaled)": (lambda c: c.update(rope_parameters={
        "rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 128}), None, CONTEXT),
    "the tokenizer's model_max_length (pooling models only)": (None, lambda t: t.update(model_max_length=512), CONTEXT),
    "no length in the config": (lambda c: c.pop("max_position_embeddings"), None, None),
}


@pytest.mark.parametrize("name", VARIANTS)
def test_the_context_is_the_one_vllm_derives(short, tmp_path, name):
    """``context_length`` equals vLLM's default ``max_model_len`` (vLLM assumes 2,048 where the
    config names no length; the stages then keep their own defaults)."""
    from vllm.config import ModelConfig

    config, tokenizer, expected = VARIANTS[name]
    target = variant(short, tmp_path, "target", config, tokenizer)
    assert context_length(target) == expected
    assert ModelConfig(model=str(target)).max_model_len == (expected or 2048)


def test_lengths_follow_the_target_and_a_longer_one_is_refused(short):
    assert sequence_length(short, None, 2048, "--max-length", reserve=1) == CONTEXT - 1
    assert sequence_length(short, None, 512, "--max-length") == 512
    assert sequence_length(short, CONTEXT - 1, 2048, "--max-length", reserve=1) == CONTEXT - 1
    with pytest.raises(EDSDError, match=f"^--max-length {CONTEXT}: {short} holds {CONTEXT} tokens per sequence, 1 of "
                                        f"them kept for the token vLLM's feature extraction generates; pass "
                                        f"--max-length {CONTEXT - 1} or less, or leave it out to follow the target$"):
        sequence_length(short, CONTEXT, 2048, "--max-length", reserve=1)


def long_chat(tokens: int) -> list[dict]:
    """A two-turn chat whose answer is about ``tokens`` tokens of the toy corpus, over and over
    (the toy tokenizer reads about 2.3 characters per token)."""
    words = " ".join(toy_corpus().split()) + " "
    text = (words * (3 * tokens // len(words) + 1))[: int(2.3 * tokens)]
    return [{"role": "user", "content": "Tell me everything."}, {"role": "assistant", "content": text}]


@pytest.mark.parametrize("command", ["train", "features", "select"])
def test_a_length_the_target_cannot_hold_is_one_line_before_any_work(short, tmp_path, capsys, command):
    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps({"messages": long_chat(64)}) + "\n")
    out = tmp_path / "out"
    own = {"train": ["--out", str(out), "--layers", "1,3"], "select": ["--out", str(out)],
           "features": ["--cache", str(out), "--feature-layers", "1,3"]}[command]
    assert main([command, str(short), *own, "--data", str(data), "--max-length", "2048", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    most = CONTEXT if command == "select" else CONTEXT - 1
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert err.startswith(f"edsd {command}: error: --max-length 2048: {short} holds {CONTEXT} tokens per sequence")
    assert f"pass --max-length {most} or less" in err
    assert not out.exists()


def test_samples_past_the_length_are_cut_and_counted(short):
    from transformers import AutoTokenizer

    from vllm_edsd.features.shards import tokenize_conversations

    tokenizer = AutoTokenizer.from_pretrained(short)
    chats = [long_chat(40), long_chat(400), long_chat(2000)]
    samples, skipped, cut = tokenize_conversations(tokenizer, chats, CONTEXT - 1)
    assert (skipped, cut, len(samples)) == (0, 1, 3)
    assert [len(ids) for ids, _ in samples][2] == CONTEXT - 1
    assert max(len(ids) for ids, _ in samples[:2]) < CONTEXT - 1


def test_a_turn_whose_prompt_does_not_fit_ends_its_conversation(short, tmp_path, capsys):
    """Regeneration (here through transformers; vLLM's engine takes the same path with its
    ``max_model_len``): a turn whose prompt leaves no room for an answer in the target's context
    ends its conversation before it; a conversation left without an answer is dropped; one line
    counts them. vLLM would otherwise refuse the whole batch."""
    long_question = {"role": "user", "content": long_chat(2000)[1]["content"]}
    fits = [{"role": "user", "content": "Hello there."}]
    conversations = [fits, [long_question], [*fits, {"role": "assistant", "content": "-"}, long_question]]
    capsys.readouterr()
    answered = answers.regenerate(str(short), conversations, tmp_path, 4, backend="transformers", device="cpu")
    out = capsys.readouterr().out
    assert [[m["role"] for m in c] for c in answered] == [["user", "assistant"], ["user", "assistant"]]
    assert [c[0]["content"] for c in answered] == ["Hello there."] * 2
    assert (f"regeneration: 2 conversations end before a turn whose prompt leaves no room for an answer in the "
            f"target's {CONTEXT} tokens; those left without any answer are dropped") in out


def test_a_nested_text_config_is_read_wherever_the_target_is(short, nested):
    """LLaVA's config.json nests the language model's settings in ``text_config``: its context,
    layer count, fingerprint and drafter shape are the language model's."""
    assert "text_config" in read_config_json(nested) and "max_position_embeddings" not in read_config_json(nested)
    assert context_length(nested) == CONTEXT and decoder_layers(nested) == 4
    assert sequence_length(nested, None, 2048, "--max-length", reserve=1) == CONTEXT - 1
    assert EDSDConfig.for_target(read_config_json(nested), (1, 3)) == EDSDConfig.for_target(read_config_json(short),
                                                                                             (1, 3))


@pytest.mark.parametrize("fold", [False, True])
def test_convert_reads_a_nested_target(short, nested, tmp_path, capsys, fold):
    """``edsd convert --target`` on a multimodal-style target: the drafter is checked against the
    language model's fingerprint (recorded), and folding reads the language model's embedding
    (not the vision tower's)."""
    from safetensors.torch import load_file

    make_drafter(short, tmp_path / "training", draft_vocab_size=256, layout=EDSD_TRAINING, seed=2)
    folding = ["--fold-token-norm"] if fold else []
    assert main(["convert", str(tmp_path / "training"), str(tmp_path / "out"), "--target", str(nested), *folding]) == 0
    out = capsys.readouterr().out
    assert "target      checked: vocab 512, hidden 256, 4 layers" in out, out
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["edsd_config"]["target"] == {"vocab_size": 512, "hidden_size": 256, "num_hidden_layers": 4,
                                               "model_type": "llama"}
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(nested.resolve())
    if fold:
        assert main(["convert", str(tmp_path / "training"), str(tmp_path / "plain"), "--target", str(short),
                     *folding]) == 0
        folded, plain = load_file(tmp_path / "out" / "model.safetensors"), load_file(tmp_path / "plain" /
                                                                                   "model.safetensors")
        assert folded.keys() == plain.keys() and all(torch.equal(folded[k], plain[k]) for k in folded)


def test_convert_refuses_a_drafter_for_another_nested_target(nested, tmp_path, capsys):
    narrow = make_target(tmp_path / "narrow", hidden_size=128, num_heads=2, num_kv_heads=1)
    make_drafter(narrow, tmp_path / "training", draft_vocab_size=256, layout=EDSD_TRAINING)
    capsys.readouterr()  # building the target logs its own progress
    assert main(["convert", str(tmp_path / "training"), str(tmp_path / "out"), "--target", str(nested)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "target hidden_size is 256" in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()


def test_cpu_engines_and_servers_hold_at_most_the_targets_context(short):
    """vllm-edsd's CPU engines and servers cap the context at 2,048 tokens, and at the target's
    own where it is shorter: vLLM refuses a ``max_model_len`` past the target's."""
    from vllm_edsd.launch.engine import CPU_MAX_MODEL_LEN, cpu_max_model_len, on_cpu
    from vllm_edsd.launch.server import server_command

    assert cpu_max_model_len(str(short)) == CONTEXT and cpu_max_model_len("someone/model") == CPU_MAX_MODEL_LEN
    if on_cpu():
        command = server_command(str(short), None, 8000)
        assert command[command.index("--max-model-len") + 1] == str(CONTEXT)


def test_the_pipeline_follows_the_target_and_refuses_a_longer_length_before_any_stage(short, tmp_path, capsys):
    """``edsd pipeline``: its derived training length (answers + 256 tokens) and EDSelect's are
    cut to the target's context; a length its config sets past the context is one line before
    the first stage runs."""
    from vllm_edsd.pipeline.config import load_config
    from vllm_edsd.pipeline.stages import Plan

    (tmp_path / "prompts.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "Hi."}]}) + "\n")

    def config(train: str) -> Path:
        path = tmp_path / "pipeline.toml"
        path.write_text(f'[target]\npath = "{short}"\n[data]\nfile = "prompts.jsonl"\nregenerate = true\n'
                        f'answer_tokens = 1024\n[train]\n{train}[output]\nwork = "work"\n')
        return path

    plan = Plan(load_config(config("")))
    assert plan.train.max_length == CONTEXT - 1
    assert plan.select_options().max_length is None  # `edsd select` follows the target itself
    capsys.readouterr()
    assert main(["pipeline", str(config("max_length = 2048\n"))]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"train.max_length 2048: {short} holds {CONTEXT} tokens per sequence" in err, err
    assert not (tmp_path / "work").exists()
