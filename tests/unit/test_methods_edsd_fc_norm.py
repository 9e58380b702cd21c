"""EDSD's norms of fc's input (``norm_before_fc``, ``fc_norm``: EAGLE 3.1's, under its names): the
config round-trips in every layout, the tensors are where the shapes say, ``edsd convert`` carries
and checks them, each changes the drafts, both at once are refused as one line."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from support.drafters import edited_copy
from support.toy import built_by_edsd_train, make_drafter

from vllm_edsd.cli import main
from vllm_edsd.errors import EDSDError
from vllm_edsd.methods.draft_config import FC_INPUT_NORMS
from vllm_edsd.methods.edsd.config import EDSDConfig
from vllm_edsd.methods.edsd.layouts import EDSD_TRAINING, EDSD_VLLM, read_edsd_config
from vllm_edsd.methods.edsd.model import EDSDDraftModel, expected_shapes

BOTH = "edsd_config.norm_before_fc and edsd_config.fc_norm both norm fc's input"


def fc_input_tensors(switch: str, width: int) -> dict[str, tuple[int, ...]]:
    """The tensors a switch adds: one norm over both aux layers, or one per layer."""
    if switch == "norm_before_fc":
        return {"input_norm.weight": (2 * width,)}
    return {f"fc_norm.{i}.weight": (width,) for i in range(2)}


def drafts(model: EDSDDraftModel, width: int) -> torch.Tensor:
    """Greedy chains on features with the first token's massive activation."""
    torch.manual_seed(1)
    features = torch.randn(2, 9, 2 * width)
    features[:, 0, 3] = 24800.0
    tokens = torch.randint(0, model.config.vocab_size, (2, 9))
    return model.propose(features, tokens, 4)


@pytest.mark.parametrize("switch", FC_INPUT_NORMS)
def test_training_and_converted_drafters_round_trip(models, tmp_path, switch):
    """edsd_config holds the switch in both layouts, the checkpoint holds its norms (and the
    expected shapes name them), ``edsd convert`` carries them, and the served directory drafts
    what the training checkpoint drafts."""
    training, served = tmp_path / "training", tmp_path / "served"
    model = make_drafter(models["llama"], training, draft_vocab_size=256, layout=EDSD_TRAINING, **{switch: True})
    width = model.config.target_hidden_size
    norms = fc_input_tensors(switch, width)
    assert {name: expected_shapes(model.config)[name] for name in norms} == norms
    assert main(["convert", str(training), str(served), "--target", models["llama"]]) == 0
    for path, layout in ((training, EDSD_TRAINING), (served, EDSD_VLLM)):
        raw = json.loads((path / "config.json").read_text())
        assert raw["edsd_config"][switch] is True and "fc_norm" not in raw and "norm_before_fc" not in raw
        assert {name: tuple(t.shape) for name, t in load_file(path / "model.safetensors").items()
                if name in norms} == norms
        found, cfg = read_edsd_config(path)
        assert found is layout
        assert [getattr(cfg, name) for name in FC_INPUT_NORMS] == [name == switch for name in FC_INPUT_NORMS]
    embed = model.embed_tokens.weight
    loaded = EDSDDraftModel.from_pretrained(served, embed_tokens=embed)
    assert torch.equal(drafts(loaded, width), drafts(model, width))


@pytest.mark.parametrize("switch", FC_INPUT_NORMS)
def test_each_switch_changes_the_drafts(models, tmp_path, switch):
    """The same weights draft otherwise with fc's input normed: the switch is no no-op."""
    plain = make_drafter(models["llama"], tmp_path / "plain", draft_vocab_size=256)
    switched = EDSDDraftModel(plain.config.with_updates(**{switch: True}))
    switched.load_state_dict(plain.state_dict(), strict=False)
    width = plain.config.target_hidden_size
    assert not torch.equal(drafts(plain, width), drafts(switched, width))


@pytest.mark.parametrize("switch", FC_INPUT_NORMS)
def test_convert_refuses_a_checkpoint_without_its_norms(models, tmp_path, capsys, switch):
    """A config that turns a norm on beside tensors without it, or with a wrong-sized one, is
    refused by name, as one line, with no output."""
    source = tmp_path / "training"
    make_drafter(models["llama"], source, draft_vocab_size=256, layout=EDSD_TRAINING, **{switch: True})
    name = next(iter(fc_input_tensors(switch, 1)))
    tensors = load_file(source / "model.safetensors")
    for case, edit in (("missing", lambda t: t.pop(name)), ("shape", lambda t: t.update({name: t[name][:-1]}))):
        edited = tmp_path / case
        edited_copy(source, edited)
        changed = dict(tensors)
        edit(changed)
        save_file(changed, edited / "model.safetensors")
        assert main(["convert", str(edited), str(tmp_path / f"{case}-out"), "--target", models["llama"]]) == 2
        err = capsys.readouterr().err
        assert name in err and len(err.strip().splitlines()) == 1, err
        assert not (tmp_path / f"{case}-out").exists()


def test_a_config_asking_for_both_norms_is_one_line(models, tmp_path):
    """vLLM would apply both; nobody trains that drafter: refused wherever the config is read."""
    make_drafter(models["llama"], tmp_path, draft_vocab_size=256, layout=EDSD_TRAINING, norm_before_fc=True)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["edsd_config"]["fc_norm"] = True
    with pytest.raises(EDSDError) as caught:
        EDSDConfig.from_dict(raw, source="config.json")
    assert str(caught.value).startswith(f"config.json: {BOTH}") and "\n" not in str(caught.value)


def test_edsd_train_builds_either_norm(models):
    """``edsd train --norm-before-fc`` / ``--fc-norm`` build EDSD's drafter with the norm."""
    for switch in FC_INPUT_NORMS:
        model = built_by_edsd_train(models["llama"], **{switch: True})
        assert getattr(model.config, switch) and set(fc_input_tensors(switch, model.config.target_hidden_size)) <= \
            set(model.state_dict())
