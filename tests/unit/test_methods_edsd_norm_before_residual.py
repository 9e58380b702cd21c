"""EDSD's ``norm_before_residual`` (EAGLE 3.1's switch, under its name): the draft layer's residual
is ``input_layernorm(u)``, the stream its attention reads, rather than the EDFuse output ``u``.
The config round-trips through ``edsd convert``, the switch changes the drafts, the float32 stream
beside 16-bit weights computes the same layer, and ``edsd train`` builds it for EDSD."""

from __future__ import annotations

import json

import torch
from support.toy import built_by_edsd_train, make_drafter

import vllm_edsd.methods.edsd.float16_range as float16_range
from vllm_edsd.cli import main
from vllm_edsd.methods.blocks import KeyValueSteps
from vllm_edsd.methods.edsd.layouts import EDSD_TRAINING, EDSD_VLLM, read_edsd_config
from vllm_edsd.methods.edsd.model import DraftDecoderLayer, EDSDDraftModel

SWITCH = "norm_before_residual"


def drafts(model: EDSDDraftModel) -> torch.Tensor:
    torch.manual_seed(1)
    features = torch.randn(2, 9, 2 * model.config.target_hidden_size)
    tokens = torch.randint(0, model.config.vocab_size, (2, 9))
    return model.propose(features, tokens, 4)


def test_training_and_converted_drafters_round_trip(models, tmp_path):
    """edsd_config holds the switch in both layouts (no tensor of its own), and the served
    directory drafts what the training checkpoint drafts."""
    training, served = tmp_path / "training", tmp_path / "served"
    model = make_drafter(models["llama"], training, draft_vocab_size=256, layout=EDSD_TRAINING,
                         attention_reads_token=True, feature_norm=True, **{SWITCH: True})
    assert main(["convert", str(training), str(served), "--target", models["llama"]]) == 0
    for path, layout in ((training, EDSD_TRAINING), (served, EDSD_VLLM)):
        assert json.loads((path / "config.json").read_text())["edsd_config"][SWITCH] is True
        found, cfg = read_edsd_config(path)
        assert found is layout and getattr(cfg, SWITCH)
    loaded = EDSDDraftModel.from_pretrained(served, embed_tokens=model.embed_tokens.weight)
    assert torch.equal(drafts(loaded), drafts(model))


def test_the_switch_changes_the_drafts(models, tmp_path):
    """The same weights draft otherwise with the normed residual: the switch is no no-op."""
    plain = make_drafter(models["llama"], tmp_path / "plain", draft_vocab_size=256, fusion_gain=5.0)
    switched = EDSDDraftModel(plain.config.with_updates(**{SWITCH: True}))
    switched.load_state_dict(plain.state_dict())
    assert not torch.equal(drafts(plain), drafts(switched))


def test_the_float32_stream_computes_the_same_layer(models, tmp_path):
    """``float16_range.decoder_layer`` (the stream beside float16 weights) with the switch is the
    reference layer's own computation when run in float32."""
    model = make_drafter(models["llama"], tmp_path / "drafter", draft_vocab_size=256,
                         attention_reads_token=True, **{SWITCH: True})
    layer: DraftDecoderLayer = model.midlayer
    torch.manual_seed(2)
    u, tokens = torch.randn(1, 6, model.config.hidden_size) * 40, torch.randn(1, 6, model.config.hidden_size)
    positions = torch.arange(6).expand(1, 6)
    with torch.no_grad():
        want = layer(u, tokens, positions, KeyValueSteps())
        got = float16_range.decoder_layer(
            u, lambda x: layer.self_attn(layer.attention_input(x, tokens), positions, KeyValueSteps()), layer.mlp,
            (layer.input_layernorm.weight, layer.input_layernorm.eps),
            (layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps), torch.float32, True,
        )
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-4)


def test_edsd_train_builds_it_for_edsd(models):
    """``edsd train --method edsd --norm-before-residual`` builds EDSD's drafter with the switch."""
    assert getattr(built_by_edsd_train(models["llama"], **{SWITCH: True}).config, SWITCH)
