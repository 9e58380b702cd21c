"""EDTrain without a training run: the schedules against the paper, the entropy mask, the
training-time-test attention pattern, the draft vocabulary, feature shards and feature noise
(the runs themselves: tests/engine/test_training_runs.py)."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from vllm_edsd.features.hidden_states import token_entropy
from vllm_edsd.methods.blocks import KeyValueSteps
from vllm_edsd.methods.edsd.config import EDSDConfig
from vllm_edsd.methods.edsd.model import EDSDDraftModel
from vllm_edsd.training.curriculum import BATCH, PAPER, SAMPLE, SPECFORGE, entropy_mask
from vllm_edsd.training.draft_vocab import build_vocab_mapping
from vllm_edsd.training.loss import ttt_loss
from vllm_edsd.training.recipe import Recipe


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


def test_a_prefix_of_the_samples_reuses_its_shards(models, monkeypatch, tmp_path):
    """Shards are named by their content: a run on more samples (a learning curve's next
    size) reuses the shards of the samples it shares and extracts only the rest."""
    from dataclasses import replace

    from vllm_edsd.features import shards
    from vllm_edsd.features.hidden_states import TransformersFeatures
    from vllm_edsd.launch.transformers_target import load_target

    monkeypatch.setattr(shards, "SHARD_SIZE", 2)
    target = TransformersFeatures(load_target(models["llama"]), (1, 3))
    spec = shards.FeatureSpec.of(models["llama"], (1, 3), "float32", "transformers")
    samples = [([1, 5 + i, 6, 7 + i], [0, 1, 1, 1]) for i in range(5)]
    first = shards.extract_features(target, samples[:4], tmp_path, spec)
    written = {p: p.stat().st_mtime_ns for p in first}
    more = shards.extract_features(target, samples, tmp_path, spec)
    assert more[:2] == first and {p: p.stat().st_mtime_ns for p in first} == written
    assert len(more) == 3 and len(set(tmp_path.glob("shard-*"))) == 3
    other_spec = shards.extract_features(target, samples[:2], tmp_path, replace(spec, backend="other"))
    assert other_spec[0] not in more


def test_feature_noise_is_relative_to_each_layers_scale():
    """A quiet early layer and a loud late one get the same relative perturbation."""
    from vllm_edsd.training.loss import add_feature_noise

    torch.manual_seed(0)
    quiet, loud = torch.randn(4, 64, 32) * 0.01, torch.randn(4, 64, 32) * 100
    noisy = add_feature_noise(torch.cat([quiet, loud], -1), 32, 0.1)
    for clean, perturbed in ((quiet, noisy[..., :32]), (loud, noisy[..., 32:])):
        ratio = ((perturbed - clean).pow(2).mean() / clean.pow(2).mean()).sqrt()
        assert ratio == pytest.approx(0.1, rel=0.05)


def test_the_draft_layer_switches_build_edsds_variant_and_are_refused_for_eagle3(models):
    """``--attention-reads-token``/``--feature-norm`` build EDSD's draft layer that reads the token
    and EDFuse's norm on the feature, recorded in the config it saves; EAGLE-3 has no such part."""
    import json
    from pathlib import Path

    from vllm_edsd.errors import EDSDError
    from vllm_edsd.launch.transformers_target import load_target
    from vllm_edsd.training.drafter import build_model
    from vllm_edsd.training.options import TrainOptions

    target = load_target(models["llama"])
    raw = json.loads((Path(models["llama"]) / "config.json").read_text())
    d2t, t2d = torch.zeros(256, dtype=torch.long), torch.zeros(raw["vocab_size"], dtype=torch.bool)
    t2d[:256] = True
    options = TrainOptions(target=models["llama"], out="unused", data="unused", attention_reads_token=True,
                           feature_norm=True)
    model = build_model(options, target, raw, (1, 3), d2t, t2d)
    assert model.config.attention_reads_token and model.config.feature_norm
    assert model.midlayer.self_attn.q_proj.in_features == 2 * model.config.hidden_size
    assert model.edfuse.feature_norm is not None
    block = model.config.to_training_dict("LlamaForCausalLMEDSD")["edsd_config"]
    assert block["attention_reads_token"] is True and block["feature_norm"] is True
    eagle3 = TrainOptions(target=models["llama"], out="unused", data="unused", method="eagle3", feature_norm=True)
    with pytest.raises(EDSDError, match="^--feature-norm: a switch of EDSD's draft layer, not eagle3's$"):
        build_model(eagle3, target, raw, (1, 2, 3), d2t, t2d)
