"""EAGLE 3.1's switches of the EAGLE-3 drafter (``methods/eagle3/config.py``): written where vLLM
reads them and read back to the same drafts, each one changing the drafts, both norms of fc's
input refused as one line wherever a config is made, and ``edsd train``'s flags."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from support.builds import EAGLE31_DRAFTERS
from support.toy import make_target, randomise, set_draft_vocab

from vllm_edsd.checkpoint.files import iter_tensors
from vllm_edsd.cli import main
from vllm_edsd.errors import EDSDError
from vllm_edsd.methods.draft_config import DraftConfig
from vllm_edsd.methods.eagle3.config import SWITCHES
from vllm_edsd.methods.eagle3.layouts import read_eagle3_config
from vllm_edsd.methods.eagle3.model import Eagle3DraftModel

LAYER = DraftConfig(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=96,
                    draft_vocab_size=48, intermediate_size=64, target_hidden_size=32)
LAYERS = (1, 2, 3)
BOTH = "norm_before_fc and fc_norm both norm fc's input"


def random_drafter(seed: int = 0, **switches: bool) -> Eagle3DraftModel:
    """A small EAGLE-3 drafter with ``switches``, every weight random (norms too)."""
    torch.manual_seed(seed)
    model = Eagle3DraftModel.build(LAYER, LAYERS, **switches)
    with torch.no_grad():
        randomise(model, [m for m in model.modules() if type(m).__name__ == "RMSNorm"])
        model.embed_tokens.weight.normal_()
        set_draft_vocab(model)
    return model


def drafts(model: Eagle3DraftModel) -> torch.Tensor:
    torch.manual_seed(1)
    features, tokens = torch.randn(2, 9, 3 * LAYER.hidden_size) * 3, torch.randint(0, LAYER.vocab_size, (2, 9))
    return model.propose(features, tokens, 4)


@pytest.mark.parametrize("name", list(EAGLE31_DRAFTERS))
def test_the_switches_round_trip_through_a_drafter_directory(tmp_path, name):
    """config.json holds every switch at the top level (where vLLM reads them), the new norms
    are ``input_norm.weight`` / ``fc_norm.{i}.weight``; the directory reads back to the same drafts."""
    switches = EAGLE31_DRAFTERS[name]
    model = random_drafter(**switches)
    model.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert {key: raw[key] for key in SWITCHES} == {key: switches.get(key, False) for key in SWITCHES}
    saved = {tensor_name for tensor_name, _ in iter_tensors(tmp_path)}
    norms = {"input_norm.weight"} if switches.get("norm_before_fc") else {f"fc_norm.{i}.weight" for i in range(3)}
    assert norms <= saved and not {"input_norm.weight", "fc_norm.0.weight"} - norms & saved
    cfg, ids = read_eagle3_config(tmp_path)
    assert cfg.switches() == {key: raw[key] for key in SWITCHES} and ids == LAYERS
    loaded = Eagle3DraftModel.from_pretrained(tmp_path, embed_tokens=model.embed_tokens.weight)
    assert torch.equal(drafts(loaded), drafts(model))


@pytest.mark.parametrize("switch", SWITCHES)
def test_each_switch_changes_the_drafts(switch):
    """The same weights draft otherwise with a switch on: no switch is a no-op."""
    plain, switched = random_drafter(), random_drafter(**{switch: True})
    switched.load_state_dict(plain.state_dict(), strict=False)
    assert not torch.equal(drafts(plain), drafts(switched))


@pytest.mark.parametrize("edit", [
    {"norm_before_fc": True, "fc_norm": True},
    {"eagle_config": {"norm_before_fc": True}, "fc_norm": True},  # vLLM reads eagle_config's first
])
def test_a_directory_asking_for_both_fc_norms_is_one_line(tmp_path, edit):
    random_drafter().save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw.update({**edit, "eagle_config": {**raw["eagle_config"], **edit.get("eagle_config", {})}})
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(EDSDError) as caught:
        read_eagle3_config(tmp_path)
    assert str(caught.value).startswith(f"{tmp_path}/config.json: {BOTH}") and "\n" not in str(caught.value)


def test_a_speculators_file_without_norm_before_residual_has_it_on(tmp_path):
    """vLLM's speculators reader turns ``norm_before_residual`` on where a speculators-format
    EAGLE-3 file leaves it out; a plain config leaves it off."""
    random_drafter().save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    del raw["norm_before_residual"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert not read_eagle3_config(tmp_path)[0].norm_before_residual
    (tmp_path / "config.json").write_text(json.dumps({**raw, "speculators_model_type": "eagle3"}))
    assert read_eagle3_config(tmp_path)[0].norm_before_residual


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return make_target(tmp_path_factory.mktemp("eagle31") / "target")


@pytest.mark.parametrize(("flags", "message"), [
    (["--method", "eagle3", "--layers", "1,2,3", "--norm-before-fc", "--fc-norm"],
     "--method eagle3: --norm-before-fc and --fc-norm both norm fc's input"),
    (["--method", "edsd", "--layers", "1,3", "--norm-output", "--fc-norm"],
     "--norm-output: a switch of EAGLE-3's draft layer, not edsd's"),
    (["--method", "edsd", "--layers", "1,3", "--norm-before-fc", "--fc-norm"],
     "--method edsd: --norm-before-fc and --fc-norm both norm fc's input"),
])
def test_edsd_train_refuses_a_switch_as_one_line_before_any_work(target, tmp_path, capsys, flags, message):
    assert main(["train", str(target), "--out", str(tmp_path / "run"), "--data", "unused.jsonl", *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "Traceback" not in err, err
    assert not (tmp_path / "run" / "cache").exists()


def test_edsd_train_flags_build_eagle31(target, capsys):
    """``--norm-before-fc --norm-before-residual --norm-output`` build EAGLE 3.1's drafter, and
    ``--help`` teaches each flag."""
    from vllm_edsd.launch.transformers_target import load_target
    from vllm_edsd.training.drafter import build_model
    from vllm_edsd.training.options import TrainOptions

    options = TrainOptions(target=str(target), out="unused", data="unused", method="eagle3", norm_before_fc=True,
                           norm_before_residual=True, norm_output=True)
    raw = json.loads((target / "config.json").read_text())
    d2t, t2d = torch.zeros(64, dtype=torch.long), torch.zeros(raw["vocab_size"], dtype=torch.bool)
    t2d[:64] = True
    model = build_model(options, load_target(target), raw, LAYERS, d2t, t2d)
    assert model.config.switches() == {**dict.fromkeys(SWITCHES, True), "fc_norm": False}
    assert model.input_norm is not None and model.fc_norm is None
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert all(f"--{name.replace('_', '-')}" in shown and f"config.json: {name}" in shown for name in SWITCHES)
