"""EDSD's residual switches: ``norm_before_residual`` (EAGLE 3.1's, under its name: the draft
layer's residual is ``input_layernorm(u)``, the stream its attention reads, rather than the EDFuse
output ``u``) and ``fuse_residual`` (EDFuse adds its feature input to its output, so the fed-back
state passes the gate). Each round-trips through ``edsd convert``, changes the drafts, is computed
alike by the float32 stream beside 16-bit weights, and is built by ``edsd train`` for EDSD."""

from __future__ import annotations

import json

import pytest
import torch
from support.toy import built_by_edsd_train, make_drafter

import vllm_edsd.methods.edsd.float16_range as float16_range
from vllm_edsd.cli import main
from vllm_edsd.methods.blocks import KeyValueSteps
from vllm_edsd.methods.edsd.layouts import EDSD_TRAINING, EDSD_VLLM, read_edsd_config
from vllm_edsd.methods.edsd.model import DraftDecoderLayer, EDFuse, EDSDDraftModel

SWITCHES = ("norm_before_residual", "fuse_residual")


def drafts(model: EDSDDraftModel) -> torch.Tensor:
    torch.manual_seed(1)
    features = torch.randn(2, 9, 2 * model.config.target_hidden_size)
    tokens = torch.randint(0, model.config.vocab_size, (2, 9))
    return model.propose(features, tokens, 4)


@pytest.mark.parametrize("switch", SWITCHES)
def test_training_and_converted_drafters_round_trip(models, tmp_path, switch):
    """edsd_config holds the switch in both layouts (no tensor of its own), and the served
    directory drafts what the training checkpoint drafts."""
    training, served = tmp_path / "training", tmp_path / "served"
    model = make_drafter(models["llama"], training, draft_vocab_size=256, layout=EDSD_TRAINING,
                         attention_reads_token=True, feature_norm=True, **{switch: True})
    assert main(["convert", str(training), str(served), "--target", models["llama"]]) == 0
    for path, layout in ((training, EDSD_TRAINING), (served, EDSD_VLLM)):
        assert json.loads((path / "config.json").read_text())["edsd_config"][switch] is True
        found, cfg = read_edsd_config(path)
        assert found is layout and getattr(cfg, switch)
    loaded = EDSDDraftModel.from_pretrained(served, embed_tokens=model.embed_tokens.weight)
    assert torch.equal(drafts(loaded), drafts(model))


@pytest.mark.parametrize("switch", SWITCHES)
def test_the_switch_changes_the_drafts(models, tmp_path, switch):
    """The same weights draft otherwise with the switch on: it is no no-op."""
    plain = make_drafter(models["llama"], tmp_path / "plain", draft_vocab_size=256, fusion_gain=5.0)
    switched = EDSDDraftModel(plain.config.with_updates(**{switch: True}))
    switched.load_state_dict(plain.state_dict())
    assert not torch.equal(drafts(plain), drafts(switched))


def test_the_float32_stream_computes_the_same_layer(models, tmp_path):
    """``float16_range.decoder_layer`` (the stream beside float16 weights) with the normed residual
    is the reference layer's own computation when run in float32."""
    model = make_drafter(models["llama"], tmp_path / "drafter", draft_vocab_size=256,
                         attention_reads_token=True, norm_before_residual=True)
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


def test_the_float32_stream_adds_the_state_past_the_gate(models, tmp_path):
    """EDFuse with float16 weights on a float32 state (``float16_range.fuse``) adds that state
    to its output in float32, as the float32 EDFuse does, for states far past float16's range."""
    model = make_drafter(models["llama"], tmp_path / "drafter", draft_vocab_size=256, fuse_residual=True)
    fuse: EDFuse = model.edfuse
    torch.manual_seed(3)
    g = torch.randn(2, 5, model.config.hidden_size) * torch.tensor([1.0, 1e6]).view(2, 1, 1)
    e = torch.randn(2, 5, model.config.hidden_size)
    with torch.no_grad():
        want = fuse(g, e)
        got = fuse.half()(g, e.half())
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    for row in range(2):  # float16's rounding of each row, relative to that row's peak
        peak = want[row].abs().amax().item()
        assert torch.allclose(got[row], want[row], rtol=0, atol=2e-3 * peak)


@pytest.mark.parametrize("switch", SWITCHES)
def test_edsd_train_builds_it_for_edsd(models, switch):
    """``edsd train --method edsd --norm-before-residual`` (or ``--fuse-residual``) builds EDSD's
    drafter with the switch."""
    assert getattr(built_by_edsd_train(models["llama"], **{switch: True}).config, switch)
