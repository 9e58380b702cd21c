"""The demo target's low-rank training form and its dense expansion: the checkpoint vLLM serves
computes what the trained factors compute; training resumes where it stopped."""

from __future__ import annotations

import json

import torch

from vllm_edsd.demo_target import (SPEC_FILE, TargetRecipe, TargetShape, expand, low_rank_model, save_factors,
                                   special_token_ids, train_target)
from vllm_edsd.target import load_target
from vllm_edsd.toy import toy_corpus, train_tokenizer

SHAPE = TargetShape(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=96, rank=8)


def _tokenizer(tmp_path):
    from transformers import AutoTokenizer

    train_tokenizer(toy_corpus().splitlines(), 300, tmp_path / "tok")
    return AutoTokenizer.from_pretrained(str(tmp_path / "tok"))


def test_expanded_dense_checkpoint_computes_the_low_rank_model(tmp_path):
    tokenizer = _tokenizer(tmp_path)
    shape = TargetShape(**{**SHAPE.__dict__, "vocab_size": len(tokenizer)})
    model = low_rank_model(shape, special_token_ids(tokenizer), seed=0).eval()
    save_factors(model, shape, tmp_path / "factors", dtype=torch.float32)
    tokenizer.save_pretrained(str(tmp_path / "factors"))
    assert json.loads((tmp_path / "factors" / SPEC_FILE).read_text())["rank"] == 8
    dense_dir = expand(tmp_path / "factors", tmp_path / "dense", dtype=torch.float32)
    dense = load_target(dense_dir)
    assert not any("." + end in n for n in dense.state_dict() for end in ("a", "b"))
    ids = torch.randint(0, len(tokenizer), (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(dense(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-4)


def test_target_training_resumes_and_extends_to_the_same_weights(tmp_path):
    tokenizer = _tokenizer(tmp_path)
    shape = TargetShape(**{**SHAPE.__dict__, "vocab_size": len(tokenizer)})
    data = torch.randint(0, len(tokenizer), (24, 16))
    recipe = TargetRecipe(cycles=(2, 2), batch_size=4, seq_len=16, warmup=1, checkpoint_every=1)
    whole = low_rank_model(shape, special_token_ids(tokenizer), seed=0)
    (tmp_path / "whole").mkdir()
    log = train_target(whole, data, recipe, tmp_path / "whole")
    assert [e["step"] for e in log] == [1, 2, 3, 4]
    assert log[2]["lr"] == recipe.restart_lr  # the second cycle restarts after its 1-step warm-up
    # A finished one-cycle run, extended by a second cycle: it resumes from its checkpoint and
    # ends where the two-cycle run did.
    (tmp_path / "split").mkdir()
    first = low_rank_model(shape, special_token_ids(tokenizer), seed=0)
    train_target(first, data, TargetRecipe(**{**recipe.__dict__, "cycles": (2,)}), tmp_path / "split")
    state = torch.load(tmp_path / "split" / "target_state.pt", weights_only=True)
    assert state["step"] == 2
    resumed = low_rank_model(shape, special_token_ids(tokenizer), seed=1)  # weights come from the checkpoint
    assert [e["step"] for e in train_target(resumed, data, recipe, tmp_path / "split")] == [1, 2, 3, 4]
    for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values()):
        torch.testing.assert_close(a, b, msg=name)
