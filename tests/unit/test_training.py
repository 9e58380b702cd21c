"""EDTrain: the schedules against the paper, the entropy mask, the training-time-test
attention pattern, the draft vocabulary, and short real training runs (both methods)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from support.toy import toy_corpus

from vllm_edsd.checkpoint.config import EDSDConfig
from vllm_edsd.cli import main
from vllm_edsd.model.edsd import EDSDDraftModel, KeyValueSteps
from vllm_edsd.target.hidden_states import token_entropy
from vllm_edsd.training.schedule import BATCH, PAPER, SAMPLE, SPECFORGE, entropy_mask
from vllm_edsd.training.trainer import Recipe, ttt_loss
from vllm_edsd.training.vocab import build_vocab_mapping


def test_paper_reading_is_eqs_5_and_6():
    """p_t = max(0, T - t - 1) * 3 (%), n_t = floor(1 + (S_max - 1) t / (T - 1))."""
    for epochs, s_max in ((8, 7), (3, 4), (5, 3), (1, 7)):
        assert [PAPER.mask_percent(t, epochs) for t in range(epochs)] == [
            max(0, epochs - t - 1) * 3 for t in range(epochs)
        ]
        floor_eq6 = [s_max if epochs == 1 else math.floor(1 + (s_max - 1) * t / (epochs - 1)) for t in range(epochs)]
        assert [PAPER.ttt_steps(t, epochs, s_max) for t in range(epochs)] == floor_eq6
    assert [PAPER.ttt_steps(t, 8, 7) for t in range(8)] == [1, 1, 2, 3, 4, 5, 6, 7]
    assert [PAPER.mask_percent(t, 8) for t in range(8)] == [21, 18, 15, 12, 9, 6, 3, 0]


def test_specforge_reading_is_its_code():
    """specforge/core/edsd.py: ceil in Step-n; drop ratio min(max((T - t - 1) * 0.02, 0), 0.4)."""
    for epochs, s_max in ((8, 7), (3, 4), (5, 3), (30, 7), (1, 7)):
        ratio = [min(max((epochs - t - 1) * 0.02, 0.0), 0.4) for t in range(epochs)]
        assert [SPECFORGE.mask_percent(t, epochs) / 100 for t in range(epochs)] == pytest.approx(ratio)
        ceil_eq6 = [s_max if epochs <= 1 else math.ceil(1 + (s_max - 1) * t / (epochs - 1)) for t in range(epochs)]
        assert [SPECFORGE.ttt_steps(t, epochs, s_max) for t in range(epochs)] == ceil_eq6
    assert [SPECFORGE.ttt_steps(t, 8, 7) for t in range(8)] == [1, 2, 3, 4, 5, 6, 7, 7]
    assert SPECFORGE.mask_percent(0, 30) == 40.0  # the cap; the paper's reading would mask 87 %


def test_learning_rate_warms_up_then_decays_to_zero():
    """SpecForge's schedule: linear warm-up over ceil(1.5 %) of the steps, then cosine to 0."""
    recipe = Recipe(lr=1e-3)
    total = 1000
    rates = [recipe.learning_rate(step, total) for step in range(total)]
    warm = math.ceil(0.015 * total)
    assert rates[:warm] == pytest.approx([1e-3 * (s + 1) / warm for s in range(warm)])
    assert max(rates) == pytest.approx(1e-3) and rates.index(max(rates)) == warm - 1
    assert rates[warm] == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(rates[warm:], rates[warm + 1:])), "decays monotonically"
    middle = warm + (total - warm) // 2
    assert rates[middle] == pytest.approx(0.5e-3, rel=1e-2)
    assert rates[-1] < 1e-3 * 1e-4
    assert Recipe(lr=1e-3, warmup=0.0).learning_rate(0, total) == pytest.approx(1e-3)
    constant = Recipe(lr=2e-4, lr_schedule="constant")
    assert {constant.learning_rate(step, total) for step in (0, 500, 999)} == {2e-4}


def test_entropy_mask_drops_the_most_uncertain_loss_positions():
    entropy = torch.tensor([[9.0, 5.0, 1.0, 4.0, 8.0, 2.0, 7.0, 3.0, 6.0, 0.5]])
    loss = torch.tensor([[0, 1, 1, 1, 0, 1, 1, 1, 1, 1]], dtype=torch.bool)  # 8 positions
    kept = entropy_mask(entropy, loss, 25)  # floor(0.25 * 8) = 2 dropped: entropies 7 and 6
    assert kept.tolist() == [[False, True, True, True, False, True, False, True, False, True]]
    assert torch.equal(entropy_mask(entropy, loss, 0), loss)


def test_entropy_mask_per_sample_or_over_the_batch():
    """The paper ranks each sample on its own; SpecForge ranks the whole batch at once."""
    entropy = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])
    valid = torch.ones(2, 4, dtype=torch.bool)
    per_sample = entropy_mask(entropy, valid, 25, SAMPLE)  # one per row: 4.0 and 8.0
    assert per_sample.tolist() == [[True, True, True, False], [True, True, True, False]]
    over_batch = entropy_mask(entropy, valid, 25, BATCH)  # floor(0.25 * 8) = 2 overall: 8.0 and 7.0
    assert over_batch.tolist() == [[True, True, True, True], [True, True, False, False]]


def test_specforge_reading_ranks_by_draft_vocabulary_entropy():
    """A position that is flat over the full vocabulary but peaked inside the draft vocabulary
    is kept by SpecForge's reading and dropped by the paper's, and vice versa."""
    cfg = EDSDConfig.from_dict(
        {
            "hidden_size": 8,
            "intermediate_size": 8,
            "num_attention_heads": 2,
            "vocab_size": 6,
            "draft_vocab_size": 2,
            "edsd_config": {
                "aux_layer_ids": [1, 2],
                "aux_layer_id_convention": "layer_input",
                "fuse_intermediate_size": 8,
            },
        }
    )
    model = EDSDDraftModel(cfg)
    with torch.no_grad():
        model.t2d.copy_(torch.tensor([True, True, False, False, False, False]))
    head = torch.eye(6, 8)  # final hidden -> logits: the first 6 hidden units are the logits
    # Position 0 predicts x_1 (assistant). Position 0: draft tokens 0/1 tied (high draft entropy),
    # the rest far below (low full entropy). Position 1: token 0 leads, tokens 1..5 close (high
    # full entropy, lower draft entropy).
    final = torch.zeros(1, 3, 8)
    final[0, 0, :6] = torch.tensor([5.0, 5.0, -9.0, -9.0, -9.0, -9.0])
    final[0, 1, :6] = torch.tensor([3.0, 1.0, 2.5, 2.5, 2.5, 2.5])
    logits = final @ head.T  # the target's; feature extraction stores: the target's argmax and entropy
    batch = {"input_ids": torch.tensor([[1, 2, 3]]), "loss_mask": torch.tensor([[False, True, True]]),
             "aux": torch.zeros(1, 3, 16), "final": final,
             "target_argmax": logits.argmax(-1), "target_entropy": token_entropy(logits)}
    paper = ttt_loss(model, batch, head[:2], 1, 50.0, "paper")
    specforge = ttt_loss(model, batch, head[:2], 1, 50.0, "specforge")
    assert (paper.eligible, paper.masked, paper.counted) == (2, 1, 1)
    assert (specforge.eligible, specforge.masked, specforge.counted) == (2, 1, 1)
    # Which one was dropped shows in the loss: the paper drops position 1, SpecForge position 0.
    drop0 = ttt_loss(model, {**batch, "loss_mask": torch.tensor([[False, False, True]])}, head[:2], 1, 0.0)
    drop1 = ttt_loss(model, {**batch, "loss_mask": torch.tensor([[False, True, False]])}, head[:2], 1, 0.0)
    torch.testing.assert_close(paper.loss, drop1.loss)
    torch.testing.assert_close(specforge.loss, drop0.loss)


def test_ttt_attention_pattern():
    """Step k at index p sees step-0 keys at indices <= p and index p's keys of steps 1..k."""
    cfg = EDSDConfig.from_dict({
        "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 2, "num_key_value_heads": 1,
        "vocab_size": 50, "edsd_config": {"aux_layer_ids": [1, 2], "aux_layer_id_convention": "layer_input",
                                         "fuse_intermediate_size": 64}})
    torch.manual_seed(0)
    model = EDSDDraftModel(cfg).double()
    t, steps = 6, 3
    features = torch.randn(1, t, 128, dtype=torch.float64)
    tokens = torch.randint(0, 50, (1, steps, t))

    def outputs(feats, toks):
        kv, g, outs = KeyValueSteps(), model.project(feats), []
        positions = torch.arange(t)[None]
        for k in range(steps):
            logits, g = model.step(g, toks[:, k], positions + k, kv)
            outs.append(logits)
        return outs

    base = outputs(features, tokens)
    # A later index's step-0 input changes nothing at earlier indices, at any step.
    changed = features.clone()
    changed[0, 4] += 1
    after = outputs(changed, tokens)
    for k in range(steps):
        assert torch.allclose(after[k][0, :4], base[k][0, :4])
        assert not torch.allclose(after[k][0, 4], base[k][0, 4])
    # A step-2 token at index 3 changes only index 3 from step 2 on.
    toks = tokens.clone()
    toks[0, 2, 3] = (toks[0, 2, 3] + 1) % 50
    after = outputs(features, toks)
    for k in range(steps):
        for p in range(t):
            same = torch.allclose(after[k][0, p], base[k][0, p])
            assert same == (k < 2 or p != 3), (k, p)
    # A step-1 token at index 2 reaches index 2 at steps 1 and 2 only (same-index keys).
    toks = tokens.clone()
    toks[0, 1, 2] = (toks[0, 1, 2] + 1) % 50
    after = outputs(features, toks)
    assert torch.allclose(after[0][0], base[0][0])
    assert [torch.allclose(after[k][0, p], base[k][0, p]) for k in (1, 2) for p in (1, 2, 3)] == [True, False, True] * 2


def test_draft_vocabulary_by_frequency():
    counts = Counter({7: 10, 3: 10, 9: 5, 1: 1})
    d2t, t2d = build_vocab_mapping(counts, 12, 3)
    ids = torch.arange(3) + d2t
    assert ids.tolist() == [3, 7, 9]
    assert torch.nonzero(t2d).flatten().tolist() == [3, 7, 9]
    d2t, t2d = build_vocab_mapping(Counter({5: 2}), 8, 3)  # fewer seen tokens than slots: pad with 0, 1
    assert (torch.arange(3) + d2t).tolist() == [0, 1, 5]


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory):
    lines = toy_corpus().splitlines()
    convs = [{"conversations": [{"from": "human", "value": a}, {"from": "gpt", "value": b}]}
             for a, b in zip(lines, lines[1:])]
    path = tmp_path_factory.mktemp("data") / "chat.json"
    path.write_text(json.dumps(convs))
    return path


def train(models, data, out, *extra) -> int:
    return main(["train", models["llama"], "--out", str(out), "--data", str(data), "--draft-vocab-size", "256",
                 "--lr", "3e-3", "--epochs", "3", "--ttt-steps", "3", "--batch-size", "4",
                 "--features-backend", "transformers", *map(str, extra)])


def test_edsd_training_learns_and_reloads(models, chat_data, tmp_path):
    assert train(models, chat_data, tmp_path / "edsd", "--layers", "1,3") == 0
    log = [json.loads(l) for l in (tmp_path / "edsd" / "train_log.jsonl").read_text().splitlines()]
    assert [e["n_t"] for e in log] == [1, 2, 3] and [e["p_t"] for e in log] == [6, 3, 0]
    assert log[-1]["acc_per_step"][0] > log[0]["acc_per_step"][0]
    assert 0 < log[0]["masked_fraction"] < 0.1 and log[-1]["masked_fraction"] == 0
    for epoch in ("epoch_0", "epoch_2", "final"):
        cfg = json.loads((tmp_path / "edsd" / epoch / "config.json").read_text())
        assert cfg["architectures"] == ["LlamaForCausalLMEDSD"] and cfg["edsd_config"]["aux_layer_ids"] == [1, 3]
    from vllm_edsd.target.hidden_states import load_target

    embed = load_target(models["llama"]).model.embed_tokens.weight
    EDSDDraftModel.from_pretrained(tmp_path / "edsd" / "final", embed_tokens=embed)


def test_eagle3_baseline_checkpoint(models, chat_data, tmp_path):
    assert train(models, chat_data, tmp_path / "e3", "--method", "eagle3", "--layers", "1,2,3") == 0
    cfg = json.loads((tmp_path / "e3" / "final" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert (
        cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3] == cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    )
    log = [json.loads(l) for l in (tmp_path / "e3" / "train_log.jsonl").read_text().splitlines()]
    assert [e["n_t"] for e in log] == [3, 3, 3] and all(e["p_t"] == 0 for e in log)
    from safetensors.torch import load_file

    tensors = load_file(tmp_path / "e3" / "final" / "model.safetensors")
    assert tensors["fc.weight"].shape == (256, 3 * 256) and "midlayer.hidden_norm.weight" in tensors
    assert "embed_tokens.weight" not in tensors


def test_interrupted_training_resumes_to_the_same_result(models, chat_data, tmp_path):
    args = ["--layers", "1,3", "--epochs", "6"]
    assert train(models, chat_data, tmp_path / "full", *args) == 0
    cut = tmp_path / "cut"
    cmd = [sys.executable, "-m", "vllm_edsd.cli", "train", models["llama"], "--out", str(cut), "--data", str(chat_data),
           "--draft-vocab-size", "256", "--lr", "3e-3", "--ttt-steps", "3", "--batch-size", "4",
           "--features-backend", "transformers", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not (cut / "training_state.pt").exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    interrupted_after = torch.load(cut / "training_state.pt", weights_only=True)["epoch"]
    assert interrupted_after < 5, "the run finished before it could be interrupted"
    assert not (cut / "final").exists()
    assert train(models, chat_data, cut, *args) == 0
    from safetensors.torch import load_file

    a = load_file(tmp_path / "full" / "final" / "model.safetensors")
    b = load_file(cut / "final" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_both_methods_share_one_feature_extraction(models, chat_data, tmp_path):
    """Features extracted once for both methods' layers (``--cache``, ``--feature-layers``)
    train the same EDSD drafter as features of its own layers, and the EAGLE-3 run on the
    same cache extracts nothing."""
    shared = tmp_path / "cache"
    assert train(models, chat_data, tmp_path / "own", "--layers", "1,3", "--epochs", "1") == 0
    assert train(models, chat_data, tmp_path / "edsd", "--layers", "1,3", "--epochs", "1",
                 "--cache", shared, "--feature-layers", "3,2,1") == 0
    written = {p: p.stat().st_mtime_ns for p in (shared / "features").glob("shard-*")}
    assert written
    assert train(models, chat_data, tmp_path / "e3", "--method", "eagle3", "--layers", "1,2,3", "--epochs", "1",
                 "--cache", shared, "--feature-layers", "1,2,3") == 0
    assert {p: p.stat().st_mtime_ns for p in (shared / "features").glob("shard-*")} == written
    from safetensors.torch import load_file

    own, picked = (load_file(tmp_path / run / "final" / "model.safetensors") for run in ("own", "edsd"))
    assert own.keys() == picked.keys() and all(torch.equal(own[k], picked[k]) for k in own)


def test_a_prefix_of_the_samples_reuses_its_shards(models, monkeypatch, tmp_path):
    """Shards are named by their content: a run on more samples (a learning curve's next
    size) reuses the shards of the samples it shares and extracts only the rest."""
    from dataclasses import replace

    from vllm_edsd.target.hidden_states import TransformersFeatures, load_target
    from vllm_edsd.training import features

    monkeypatch.setattr(features, "SHARD_SIZE", 2)
    target = TransformersFeatures(load_target(models["llama"]), (1, 3))
    spec = features.FeatureSpec.of(models["llama"], (1, 3), "float32", "transformers")
    samples = [([1, 5 + i, 6, 7 + i], [0, 1, 1, 1]) for i in range(5)]
    first = features.extract_features(target, samples[:4], tmp_path, spec)
    written = {p: p.stat().st_mtime_ns for p in first}
    more = features.extract_features(target, samples, tmp_path, spec)
    assert more[:2] == first and {p: p.stat().st_mtime_ns for p in first} == written
    assert len(more) == 3 and len(set(tmp_path.glob("shard-*"))) == 3
    other_spec = features.extract_features(target, samples[:2], tmp_path, replace(spec, backend="other"))
    assert other_spec[0] not in more


class _MakesDirectory:
    """Unpickling this creates a directory: what a hostile training state could do."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return os.mkdir, (str(self.path),)


@pytest.mark.parametrize(("content", "reason"), [("code", "GLOBAL posix.mkdir"), ("garbage", None)])
def test_resume_never_unpickles_code(models, chat_data, tmp_path, capsys, content, reason):
    """A training state planted in --out (or a corrupt one) is one clear error naming torch's
    reason, without torch's advice to load it unsafely; nothing in it runs."""
    out, marker = tmp_path / "run", tmp_path / "unpickled"
    out.mkdir()
    if content == "code":
        torch.save({"recipe": _MakesDirectory(marker), "model": {}, "optimizer": {}, "epoch": 0},
                   out / "training_state.pt")
    else:
        (out / "training_state.pt").write_bytes(b"not a torch file")
    assert train(models, chat_data, out, "--layers", "1,3") == 2
    err = capsys.readouterr().err
    assert "not a training state this trainer wrote" in err and "Traceback" not in err
    assert "weights_only" not in err and (reason is None or reason in err), err
    assert not marker.exists()


def test_bad_training_arguments(models, chat_data, tmp_path, capsys):
    assert train(models, chat_data, tmp_path / "x") == 2
    assert "needs its two aux layers" in capsys.readouterr().err
    # Both once meant --layers-from, silently: an ablation's --layers was ignored.
    with pytest.raises(SystemExit) as refused:
        train(models, chat_data, tmp_path / "x", "--layers", "1,3", "--layers-from", tmp_path / "layers.json")
    assert refused.value.code == 2
    assert "--layers-from: not allowed with argument --layers" in capsys.readouterr().err
    assert train(models, chat_data, tmp_path / "x", "--layers", "1,9") == 2
    assert "must lie in 0..4" in capsys.readouterr().err
    assert train(models, chat_data, tmp_path / "x", "--method", "eagle3", "--layers", "1,2") == 2
    assert "needs 3 distinct" in capsys.readouterr().err
    assert train(models, chat_data, tmp_path / "x", "--layers", "1,3", "--feature-layers", "1,2") == 2
    assert "--feature-layers [1, 2] must include the drafter's layers [1, 3]" in capsys.readouterr().err
    assert train(models, chat_data, tmp_path / "x", "--layers", "1,3", "--feature-layers", "1,3,x") == 2
    assert "expected comma-separated integers" in capsys.readouterr().err
    # A 0 once silently meant "the default" (the full vocabulary); every number is checked first.
    for flag, value, expected in [("--draft-vocab-size", "0", "--draft-vocab-size must be in 1..512"),
                                  ("--draft-vocab-size", "513", "--draft-vocab-size must be in 1..512"),
                                  ("--epochs", "0", "--epochs must be a positive integer"),
                                  ("--lr", "-1", "--lr must be positive"),
                                  ("--warmup", "1", "--warmup is a fraction of the optimizer steps"),
                                  ("--weight-decay", "-0.1", "--weight-decay must be 0 or more")]:
        assert train(models, chat_data, tmp_path / "x", "--layers", "1,3", flag, value) == 2
        assert expected in capsys.readouterr().err
    assert not (tmp_path / "x").exists(), "a refused run wrote nothing"


def test_feature_noise_is_relative_to_each_layers_scale():
    """A quiet early layer and a loud late one get the same relative perturbation."""
    from vllm_edsd.training.trainer import add_feature_noise

    torch.manual_seed(0)
    quiet, loud = torch.randn(4, 64, 32) * 0.01, torch.randn(4, 64, 32) * 100
    noisy = add_feature_noise(torch.cat([quiet, loud], -1), 32, 0.1)
    for clean, perturbed in ((quiet, noisy[..., :32]), (loud, noisy[..., 32:])):
        ratio = ((perturbed - clean).pow(2).mean() / clean.pow(2).mean()).sqrt()
        assert ratio == pytest.approx(0.1, rel=0.05)
