"""``edsd convert``: layouts, layer-id conventions, folding, and every kind of bad input
refused with one clear message and no output directory."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from support.drafters import edited_copy
from support.toy import make_drafter

from vllm_edsd.checkpoint.target import decoder_layers
from vllm_edsd.cli import main
from vllm_edsd.errors import EDSDError
from vllm_edsd.features.hidden_states import run_target
from vllm_edsd.launch.transformers_target import load_target
from vllm_edsd.methods.edsd.config import LAYERNORM, TOKEN_NORMS, EDSDConfig
from vllm_edsd.methods.edsd.layouts import EDSD_TRAINING, read_edsd_config
from vllm_edsd.methods.edsd.model import EDSDDraftModel


@pytest.fixture(scope="module")
def training_ckpts(models, tmp_path_factory) -> dict[str, Path]:
    """Training-layout drafters, one per token norm, whose norms are not the identity (so
    folding matters)."""
    root = tmp_path_factory.mktemp("train-ckpt")
    for norm in TOKEN_NORMS:
        make_drafter(models["llama"], root / norm, draft_vocab_size=256, layout=EDSD_TRAINING, token_norm=norm, seed=5)
    return {norm: root / norm for norm in TOKEN_NORMS}


@pytest.fixture(scope="module")
def training_ckpt(training_ckpts) -> Path:
    """The LayerNorm one: it has the most tensors to get wrong."""
    return training_ckpts[LAYERNORM]


def run_convert(capsys, *args) -> tuple[int, str, str]:
    code = main(["convert", *map(str, args)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_converts_and_summarises(models, training_ckpt, tmp_path, capsys):
    code, out, _ = run_convert(capsys, training_ckpt, tmp_path / "out", "--target", models["llama"])
    assert code == 0
    assert "aux layers  [1, 3] (layer_input) = [1, 3] in vLLM's convention" in out
    assert "draft 256 of target 512" in out
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["architectures"] == ["EDSDLlamaForCausalLM"]
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 3]
    assert cfg["edsd_config"]["converter"]["name"] == "vllm-edsd"
    assert cfg["edsd_config"]["source"]["aux_layer_id_convention"] == "layer_input"
    assert cfg["edsd_config"]["target"]["num_hidden_layers"] == 4
    names = set(load_file(tmp_path / "out" / "model.safetensors"))
    assert {"edfuse.feature_gate.weight", "edfuse.token_up.weight", "edfuse.fuse_down.weight"} <= names
    assert not any(n.startswith(("edfuse.gate_proj", "edfuse.up_proj")) for n in names)


SIDE_TENSORS = {
    "midlayer.self_attn.rotary_emb.inv_freq": torch.ones(32),
    "midlayer.self_attn.k_proj.k_scale": torch.tensor(0.5),
    "midlayer.self_attn.v_proj.v_scale": torch.tensor(0.25),
}


def test_rope_caches_are_dropped_and_kv_scales_kept(models, training_ckpt, tmp_path, capsys):
    """Exporters write RoPE caches and KV-cache scales beside the weights, and vLLM's own
    loaders accept both: conversion drops the caches (every reader recomputes them), keeps
    the scales for vLLM, and the reference model loads either file."""
    src = edited_copy(training_ckpt, tmp_path / "src", edit_tensors=lambda t: t.update(SIDE_TENSORS))
    code, _, err = run_convert(capsys, src, tmp_path / "out", "--target", models["llama"])
    assert code == 0, err
    out = load_file(tmp_path / "out" / "model.safetensors")
    assert "midlayer.self_attn.rotary_emb.inv_freq" not in out
    assert (
        out["midlayer.self_attn.k_proj.k_scale"].item() == 0.5
        and out["midlayer.self_attn.v_proj.v_scale"].item() == 0.25
    )
    embed = load_target(models["llama"]).model.embed_tokens.weight
    with_side, without = (
        EDSDDraftModel.from_pretrained(path, embed_tokens=embed).state_dict() for path in (src, training_ckpt)
    )
    assert with_side.keys() == without.keys() and all(torch.equal(with_side[k], without[k]) for k in without)


def test_layer_output_convention_shifts_ids(training_ckpt, tmp_path, capsys):
    def specforge(cfg):
        cfg["edsd_config"]["aux_layer_ids"] = [0, 2]
        cfg["edsd_config"]["aux_layer_id_convention"] = "layer_output"

    src = edited_copy(training_ckpt, tmp_path / "src", specforge)
    code, out, _ = run_convert(capsys, src, tmp_path / "out")
    assert code == 0 and "[0, 2] (layer_output) = [1, 3]" in out
    assert json.loads((tmp_path / "out" / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == [1, 3]
    # The flag overrides the file.
    code, out, _ = run_convert(capsys, src, tmp_path / "out2", "--layer-id-convention", "layer_input")
    assert code == 0 and "[0, 2] (layer_input) = [0, 2]" in out


@pytest.mark.parametrize("norm", TOKEN_NORMS)
def test_folded_and_unfolded_drafters_agree(models, training_ckpts, tmp_path, capsys, norm):
    assert run_convert(capsys, training_ckpts[norm], tmp_path / "plain", "--target", models["llama"])[0] == 0
    code, out, _ = run_convert(
        capsys, training_ckpts[norm], tmp_path / "folded", "--target", models["llama"], "--fold-token-norm"
    )
    assert code == 0 and f"token norm  {norm}, folded" in out
    folded_cfg = read_edsd_config(tmp_path / "folded")[1]
    assert folded_cfg.token_norm_folded and folded_cfg.token_norm == norm
    assert "edfuse.token_norm.weight" not in load_file(tmp_path / "folded" / "model.safetensors")
    target = load_target(models["llama"])
    embed = target.model.embed_tokens.weight
    plain = EDSDDraftModel.from_pretrained(tmp_path / "plain", embed_tokens=embed)
    folded = EDSDDraftModel.from_pretrained(tmp_path / "folded")
    assert folded.edfuse.token_norm is None
    sequence = torch.randint(3, 500, (1, 40), generator=torch.Generator().manual_seed(0))
    features = run_target(target, sequence, plain.config.aux_layer_ids).features(plain.config.aux_layer_ids)
    g, tokens = plain.project(features[:, :-1]), sequence[:, 1:]
    positions = torch.arange(tokens.shape[1])[None]
    from vllm_edsd.methods.blocks import KeyValueSteps

    logits_plain, _ = plain.step(g, tokens, positions, KeyValueSteps())
    logits_folded, _ = folded.step(g, tokens, positions, KeyValueSteps())
    torch.testing.assert_close(logits_folded, logits_plain, rtol=1e-4, atol=1e-4)
    assert torch.equal(plain.propose(features[:, :-1], tokens, 4), folded.propose(features[:, :-1], tokens, 4))


def test_sharded_and_bin_inputs_give_identical_tensors(training_ckpt, tmp_path, capsys):
    tensors = load_file(training_ckpt / "model.safetensors")
    names = sorted(tensors)
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    shutil.copy(training_ckpt / "config.json", sharded)
    weight_map = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
        file = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, sharded / file)
        weight_map.update({n: file for n in part})
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    shutil.copy(training_ckpt / "config.json", legacy)
    torch.save(tensors, legacy / "pytorch_model.bin")
    results = []
    for src in (training_ckpt, sharded, legacy):
        assert run_convert(capsys, src, tmp_path / f"out-{src.name}")[0] == 0
        results.append(load_file(tmp_path / f"out-{src.name}" / "model.safetensors"))
    for other in results[1:]:
        assert other.keys() == results[0].keys()
        assert all(torch.equal(other[n], results[0][n]) and other[n].dtype == results[0][n].dtype for n in other)


def test_dtype_and_force(training_ckpt, tmp_path, capsys):
    dst = tmp_path / "out"
    assert run_convert(capsys, training_ckpt, dst, "--dtype", "bfloat16")[0] == 0
    assert load_file(dst / "model.safetensors")["fc.weight"].dtype == torch.bfloat16
    assert json.loads((dst / "config.json").read_text())["torch_dtype"] == "bfloat16"
    code, _, err = run_convert(capsys, training_ckpt, dst)
    assert code == 2 and "already exists (use --force" in err
    assert run_convert(capsys, training_ckpt, dst, "--force", "--dtype", "float16")[0] == 0
    assert load_file(dst / "model.safetensors")["fc.weight"].dtype == torch.float16


@pytest.mark.parametrize("kind", ["other directory", "drafter plus a user's file", "file"])
def test_force_never_replaces_what_convert_did_not_write(training_ckpt, tmp_path, capsys, kind):
    """A mistyped DST with --force (a home directory, a drafter someone put notes in, a file)
    is refused with one line and left exactly as it was."""
    dst = tmp_path / "dst"
    if kind == "file":
        dst.write_text("keep me")
    else:
        if kind == "drafter plus a user's file":
            assert run_convert(capsys, training_ckpt, dst)[0] == 0
        else:
            dst.mkdir()
        (dst / "notes.txt").write_text("keep me")
    before = sorted(p.name for p in dst.iterdir()) if dst.is_dir() else None
    code, out, err = run_convert(capsys, training_ckpt, dst, "--force")
    assert code == 2 and "refusing to replace it with --force" in err and "Traceback" not in err + out
    if kind == "file":
        assert dst.read_text() == "keep me"
    else:
        assert sorted(p.name for p in dst.iterdir()) == before and (dst / "notes.txt").read_text() == "keep me"


def _truncate(path: Path) -> None:
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])


def _nan(tensors):
    tensors["norm.weight"][3] = float("nan")


def _eagle3_fc(tensors):
    tensors["fc.weight"] = torch.zeros(256, 3 * 256)


BAD_INPUTS = {
    "missing tensor": (
        {"tensors": lambda t: t.pop("edfuse.up_proj.weight")},
        "missing tensor(s): edfuse.up_proj.weight",
    ),
    "unexpected tensor": (
        {"tensors": lambda t: t.update({"midlayer.hidden_norm.weight": torch.ones(256)})},
        "unexpected tensor(s): midlayer.hidden_norm.weight",
    ),
    "wrong shape": (
        {"tensors": lambda t: t.update({"norm.weight": torch.ones(255)})},
        "tensor 'norm.weight' has shape [255], expected [256]",
    ),
    "eagle3 fc": ({"tensors": _eagle3_fc}, "fc reads three target layers"),
    "d2t length": ({"tensors": lambda t: t.update({"d2t": t["d2t"][:-1].clone()})}, "tensor 'd2t' has shape [255]"),
    "t2d count": (
        {"tensors": lambda t: t["t2d"].__setitem__(t["t2d"].nonzero()[0, 0].item(), False)},
        "'t2d' marks 255 target ids but draft_vocab_size is 256",
    ),
    "d2t disagrees": ({"tensors": lambda t: t["d2t"].__setitem__(5, t["d2t"][5] + 1)}, "'d2t' and 't2d' disagree"),
    "three aux ids": ({"config": lambda c: c["edsd_config"].update(aux_layer_ids=[1, 2, 3])}, "exactly two"),
    "missing field": ({"config": lambda c: c.pop("hidden_size")}, "missing field 'hidden_size'"),
    "bad convention": (
        {"config": lambda c: c["edsd_config"].update(aux_layer_id_convention="middle")},
        "convention 'middle' is not one of",
    ),
    "bad dtype field": ({"config": lambda c: c.update(torch_dtype="float8")}, "field 'torch_dtype' is 'float8'"),
    "nan": ({"tensors": _nan}, "tensor 'norm.weight' contains NaN or Inf"),
    "int weights": (
        {"tensors": lambda t: t.update({"norm.weight": torch.ones(256, dtype=torch.int32)})},
        "tensor 'norm.weight' has dtype torch.int32",
    ),
    "draft vocab zero": (
        {"config": lambda c: c.update(draft_vocab_size=0)},
        "field 'draft_vocab_size' must be an integer in 1..vocab_size",
    ),
    "head_dim zero": ({"config": lambda c: c.update(head_dim=0)}, "field 'head_dim' must be a positive integer, got 0"),
    "head_dim odd": ({"config": lambda c: c.update(head_dim=63)}, "field 'head_dim' must be even"),
    "heads do not divide": (
        {"config": lambda c: (c.pop("head_dim", None), c.update(num_attention_heads=7))},
        "hidden_size=256 is not a multiple of num_attention_heads=7",
    ),
    "kv heads not a number": (
        {"config": lambda c: c.update(num_key_value_heads="two")},
        "field 'num_key_value_heads' must be a positive integer, got 'two'",
    ),
    "target width not a number": (
        {"config": lambda c: c.update(target_hidden_size="wide")},
        "field 'target_hidden_size' must be a positive integer, got 'wide'",
    ),
    "eps not a number": (
        {"config": lambda c: c.update(rms_norm_eps="small")},
        "field 'rms_norm_eps' must be a positive number, got 'small'",
    ),
    "llama3 rope incomplete": (
        {"config": lambda c: c.update(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0})},
        "llama3 RoPE needs 'low_freq_factor' as a positive number, got missing",
    ),
    "weight-quantization tensor": (
        {"tensors": lambda t: t.update({"midlayer.mlp.down_proj.weight_scale": torch.ones(1)})},
        "a weight-quantization tensor: quantized EDSD drafters are not supported",
    ),
    "linear rope factor": (
        {"config": lambda c: c.update(rope_parameters={"rope_type": "linear", "factor": "x"})},
        "linear RoPE needs 'factor' as a positive number, got 'x'",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_refused(training_ckpt, tmp_path, capsys, case):
    edits, expected = BAD_INPUTS[case]
    src = edited_copy(training_ckpt, tmp_path / "src", edits.get("config"), edits.get("tensors"))
    dst = tmp_path / "out"
    code, out, err = run_convert(capsys, src, dst)
    assert code == 2
    assert expected in err
    assert "Traceback" not in err + out
    assert not dst.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")], "a partial output was left behind"


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        ("truncated", "truncated or corrupt"),
        ("invalid json", "invalid JSON"),
        ("no source", "no such directory"),
        ("vllm layout", "already in the vLLM layout"),
        ("other target", "does not fit the target model"),
        ("target without sizes", "config.json: missing field 'hidden_size'"),
        ("fold without target", "--fold-token-norm needs --target"),
        ("fold a token-reading drafter", "attention also reads the token"),
        ("bad dtype flag", "invalid choice"),
    ],
)
def test_bad_files_and_flags(models, training_ckpt, tmp_path, capsys, make, expected):
    src, extra = tmp_path / "src", []
    if make == "truncated":
        _truncate(edited_copy(training_ckpt, src))
    elif make == "invalid json":
        edited_copy(training_ckpt, src)
        (src / "config.json").write_text("{")
    elif make == "vllm layout":
        make_drafter(models["llama"], src, draft_vocab_size=256)
    elif make == "other target":
        edited_copy(training_ckpt, src)
        extra = ["--target", models["llama-narrow"]]
    elif make == "target without sizes":
        edited_copy(training_ckpt, src)
        target = edited_copy(models["llama"], tmp_path / "target", edit_config=lambda c: c.pop("hidden_size"))
        extra = ["--target", str(target)]
    elif make == "fold without target":
        edited_copy(training_ckpt, src)
        extra = ["--fold-token-norm"]
    elif make == "fold a token-reading drafter":
        make_drafter(models["llama"], src, draft_vocab_size=256, layout=EDSD_TRAINING, attention_reads_token=True)
        extra = ["--target", models["llama"], "--fold-token-norm"]
    elif make == "bad dtype flag":
        edited_copy(training_ckpt, src)
        extra = ["--dtype", "float64"]
    dst = tmp_path / "out"
    try:
        code, out, err = run_convert(capsys, src, dst, *extra)
    except SystemExit as exit_:  # argparse rejects the flag itself
        code, err = exit_.code, capsys.readouterr().err
    assert code == 2
    assert expected in err
    assert not dst.exists()


def _target_without(models, tmp_path: Path, field: str) -> Path:
    """A copy of the toy Llama target whose config.json lacks ``field``."""
    return edited_copy(models["llama"], tmp_path / "target", edit_config=lambda c: c.pop(field))


def test_a_target_without_a_layer_count_converts_unchecked(models, training_ckpt, tmp_path, capsys):
    """num_hidden_layers is optional in a target's fingerprint: without it the drafter is checked
    against the target's sizes, not its aux layer ids, and the summary says so."""
    target = _target_without(models, tmp_path, "num_hidden_layers")
    code, out, err = run_convert(capsys, training_ckpt, tmp_path / "out", "--target", target)
    assert code == 0, err
    assert "target      checked: vocab 512, hidden 256, layer count not in its config.json" in out
    recorded = json.loads((tmp_path / "out" / "config.json").read_text())["edsd_config"]["target"]
    assert recorded == {"vocab_size": 512, "hidden_size": 256, "model_type": "llama"}
    target_config = json.loads((target / "config.json").read_text())
    assert EDSDConfig.for_target(target_config, (1, 3)).target.num_hidden_layers is None


def test_a_target_without_its_sizes_is_refused_by_file_and_field(models, training_ckpt, tmp_path, capsys):
    target = _target_without(models, tmp_path, "vocab_size")
    code, _, err = run_convert(capsys, training_ckpt, tmp_path / "out", "--target", target)
    assert code == 2 and err.count("\n") == 1
    assert f"{target}/config.json: missing field 'vocab_size'" in err
    assert not (tmp_path / "out").exists()


def test_choosing_layers_needs_the_target_layer_count(models, tmp_path):
    """Where the layer count is needed (EAGLE-3's default layers, feature extraction), its absence
    is one error naming the file and the field."""
    target = _target_without(models, tmp_path, "num_hidden_layers")
    with pytest.raises(EDSDError, match=f"^{target}/config.json: missing field 'num_hidden_layers'"):
        decoder_layers(target)
    assert decoder_layers(models["llama"]) == 4
