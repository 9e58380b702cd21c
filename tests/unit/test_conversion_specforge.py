"""SpecForge's EDSD checkpoints (``EdsdDraftModel``): the reference model follows SpecForge's
semantics, ``edsd convert`` turns every variant of the layout into the same vLLM drafter
without opening ``training_state.pt``, and every bad input is refused with one clear line and
nothing left behind. Serving parity of converted SpecForge drafters is in test_serving_engines.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support.drafters import edited_copy, edsd_spec, engine_config
from support.specforge_layout import specforge_chains, write_specforge_checkpoint

from vllm_edsd.cli import main
from vllm_edsd.errors import EDSDError
from vllm_edsd.features.hidden_states import run_target
from vllm_edsd.launch.transformers_target import load_target
from vllm_edsd.methods.edsd.model import EDSDDraftModel

K = 4
VARIANTS = {
    "single": {},
    "single-with-embedding": {"with_embedding": True},
    "sharded": {"sharded": True},
    "sharded-with-embedding": {"sharded": True, "with_embedding": True},
}


@pytest.fixture(scope="module")
def checkpoints(models, tmp_path_factory) -> dict[str, Path]:
    """The same SpecForge drafter (seed 7) saved four ways, each as a SpecForge save folder."""
    root = tmp_path_factory.mktemp("specforge")
    out = {}
    for name, options in VARIANTS.items():
        out[name] = root / name / "epoch_2_step_300"
        write_specforge_checkpoint(models["llama"], out[name], seed=7, **options)
    return out


@pytest.fixture(scope="module")
def target(models):
    return load_target(models["llama"])


def run_convert(capsys, *args) -> tuple[int, str, str]:
    code = main(["convert", *map(str, args)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("variant", ["single", "sharded-with-embedding"])
def test_reference_follows_specforge_semantics(checkpoints, target, variant):
    """The reference model loaded from a SpecForge checkpoint drafts what SpecForge's own
    forward drafts, first step and fed-back steps, from every prefix of a real target run."""
    path = checkpoints[variant]
    embed = target.model.embed_tokens.weight
    drafter = EDSDDraftModel.from_pretrained(path, embed_tokens=embed)
    assert drafter.config.aux_layer_ids == (1, 3)  # SpecForge's [0, 2] are the outputs of layers 0 and 2
    assert drafter.config.token_norm == "rmsnorm"
    sequence = torch.randint(3, 500, (2, 48), generator=torch.Generator().manual_seed(1))
    features = run_target(target, sequence, (1, 3)).features((1, 3))[:, :-1]
    ours = drafter.propose(features, sequence[:, 1:], K)
    tensors = {n: t for n, t in load_file(path / "model.safetensors").items()} if variant == "single" else \
        {n: t for f in sorted(path.glob("model-*.safetensors")) for n, t in load_file(f).items()}
    theirs = specforge_chains(
        tensors, json.loads((path / "config.json").read_text()), embed, features, sequence[:, 1:], K
    )
    assert torch.equal(ours, theirs)
    assert len(set(ours[..., 0].flatten().tolist())) > 5, "the drafts should depend on the weights"


def test_every_variant_converts_to_the_same_drafter(models, checkpoints, tmp_path, capsys):
    converted = {}
    for name, src in checkpoints.items():
        code, out, err = run_convert(capsys, src, tmp_path / name, "--target", models["llama"])
        assert code == 0, err
        assert "(a SpecForge EdsdDraftModel checkpoint)" in out
        assert "aux layers  [0, 2] (layer_output) = [1, 3] in vLLM's convention" in out
        assert "token norm  rmsnorm, kept" in out
        assert ("equals the target's" if "embedding" in name else "none in the checkpoint") in out
        assert not (src / "UNPICKLED").exists(), "training_state.pt was unpickled"
        converted[name] = load_file(tmp_path / name / "model.safetensors")
        cfg = json.loads((tmp_path / name / "config.json").read_text())
        assert cfg["architectures"] == ["EDSDLlamaForCausalLM"]
        assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 3]
        assert cfg["edsd_config"]["token_norm"] == "rmsnorm"
        assert cfg["edsd_config"]["fuse_intermediate_size"] == cfg["intermediate_size"]
        assert cfg["edsd_config"]["source"] == {
            "path": f"{src.parent.name}/{src.name}", "layout": "specforge-edsd",
            "aux_layer_ids": [0, 2], "aux_layer_id_convention": "layer_output",
        }
    reference = converted["single"]
    assert "embed_tokens.weight" not in reference and "embnorm.weight" not in reference
    assert {"edfuse.token_norm.weight", "midlayer.input_layernorm.weight", "edfuse.feature_gate.weight"} <= set(
        reference
    )
    for tensors in converted.values():
        assert tensors.keys() == reference.keys()
        assert all(torch.equal(tensors[n], reference[n]) for n in tensors)


def test_output_directory_of_a_run_takes_its_latest_save(models, checkpoints, tmp_path, capsys):
    """A SpecForge output directory holds epoch_*_step_* saves: the latest one is converted."""
    run = tmp_path / "run"
    write_specforge_checkpoint(models["llama"], run / "epoch_0_step_100", seed=1)
    write_specforge_checkpoint(models["llama"], run / "epoch_1_step_90", seed=2)
    write_specforge_checkpoint(models["llama"], run / "epoch_0_step_200", seed=3)
    code, out, _ = run_convert(capsys, run, tmp_path / "out")
    assert code == 0
    assert f"converted   {run / 'epoch_1_step_90'}" in out


def test_serving_a_specforge_checkpoint_directly_says_convert(models, checkpoints):
    with pytest.raises(EDSDError, match="a SpecForge EdsdDraftModel checkpoint, not the vLLM layout; convert it first"):
        engine_config(models["llama"], edsd_spec(checkpoints["single"]))


def _three_ids(cfg):
    cfg["target_layer_ids"] = [0, 1, 2]


def _corrupt_mapping(tensors):
    tensors["d2t"][7] += 1


BAD = {
    "missing embnorm": ({"tensors": lambda t: t.pop("embnorm.weight")}, [], "missing tensor(s): embnorm.weight"),
    "three layer ids": ({"config": _three_ids}, [], "field 'target_layer_ids' must list exactly two"),
    "no layer ids": ({"config": lambda c: c.pop("target_layer_ids")}, [], "missing field 'target_layer_ids'"),
    "layer id outside the target": (
        {"config": lambda c: c.update(target_layer_ids=[0, 4])},
        ["--target"],
        "[5] do not exist in a target with 4 layers",
    ),
    "wrong shape": (
        {"tensors": lambda t: t.update({"edfuse.up_proj.weight": torch.zeros(512, 128)})},
        [],
        "tensor 'edfuse.up_proj.weight' has shape [512, 128], expected [512, 256]",
    ),
    "eagle3-style attention": (
        {"tensors": lambda t: t.update({"midlayer.self_attn.q_proj.weight": torch.zeros(256, 512)})},
        [],
        "tensor 'midlayer.self_attn.q_proj.weight' has shape [256, 512], expected [256, 256]",
    ),
    "d2t and t2d disagree": ({"tensors": _corrupt_mapping}, [], "'d2t' and 't2d' disagree"),
    "t2d count": (
        {"tensors": lambda t: t.update({"t2d": torch.ones(512, dtype=torch.bool)})},
        [],
        "'t2d' marks 512 target ids but draft_vocab_size is 256",
    ),
    "embedding of another target": (
        {"tensors": lambda t: t.update({"embed_tokens.weight": torch.randn(512, 256)})},
        ["--target"],
        "differs from the embedding of",
    ),
    "nan": (
        {"tensors": lambda t: t["embnorm.weight"].__setitem__(0, float("nan"))},
        [],
        "tensor 'embnorm.weight' contains NaN or Inf",
    ),
    "unsupported dtype field": (
        {"config": lambda c: c.update(torch_dtype="float8")},
        [],
        "field 'torch_dtype' is 'float8'",
    ),
    "input_layernorm present": (
        {"tensors": lambda t: t.update({"midlayer.input_layernorm.weight": torch.ones(256)})},
        [],
        "unexpected tensor(s): midlayer.input_layernorm.weight",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_specforge_input_is_refused(models, checkpoints, tmp_path, capsys, case):
    edits, flags, expected = BAD[case]
    src = edited_copy(checkpoints["single-with-embedding"], tmp_path / "src", edits.get("config"), edits.get("tensors"))
    extra = ["--target", models["llama"]] if flags else []
    dst = tmp_path / "out"
    code, out, err = run_convert(capsys, src, dst, *extra)
    assert code == 2
    assert expected in err
    assert "Traceback" not in out + err
    assert not dst.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")], "a partial output was left behind"
    assert not (src / "UNPICKLED").exists()
