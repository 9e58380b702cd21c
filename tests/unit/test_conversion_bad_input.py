"""``edsd convert`` given bad input or interrupted: one clear line and no partial output, nothing
deleted that the user did not name, outputs that follow the umask and record relative provenance."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from support.drafters import edited_copy
from support.toy import make_drafter

from vllm_edsd.cli import main
from vllm_edsd.errors import EDSDError
from vllm_edsd.methods.edsd.layouts import EDSD_TRAINING
from weights_convert import convert

BIG = 10**9


@pytest.fixture(scope="module")
def training_ckpt(models, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("bad-input")
    make_drafter(models["llama"], root / "edsd", draft_vocab_size=256, layout=EDSD_TRAINING, seed=7)
    return root / "edsd"


def run_convert(capsys, *args) -> tuple[int, str]:
    code = main(["convert", *map(str, args)])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    return code, captured.err


def one_line_refusal(capsys, src, dst, expected: str, *extra) -> None:
    code, err = run_convert(capsys, src, dst, *extra)
    assert code == 2 and expected in err and len(err.strip().splitlines()) == 1, err
    assert not Path(dst).exists()


def test_convert_range_checks_d2t_without_t2d(models, tmp_path, capsys):
    """A full-vocabulary drafter may carry d2t alone; an entry past the vocabulary is named."""
    make_drafter(models["llama"], tmp_path / "full", layout=EDSD_TRAINING)
    bad = torch.zeros(512, dtype=torch.long)
    bad[3] = BIG
    src = edited_copy(tmp_path / "full", tmp_path / "src", edit_tensors=lambda t: t.update(d2t=bad))
    one_line_refusal(capsys, src, tmp_path / "out", f"maps draft id 3 to target id 3 + d2t[3] = 3 + {BIG}")


def _during_conversion(action):
    """A ``progress`` callback of ``convert`` that runs ``action`` while tensors are read."""
    def progress(items, total):
        action()
        return items
    return progress


def test_a_directory_appearing_at_dst_is_never_deleted(training_ckpt, tmp_path, monkeypatch):
    """Someone creates DST while the output is being written (after every early check)."""
    import safetensors.torch

    dst, save_file_ = tmp_path / "out", safetensors.torch.save_file

    def someone_else_writes_first(*args, **kwargs):
        if not dst.exists():
            dst.mkdir()
            (dst / "theirs.txt").write_text("keep me")
        return save_file_(*args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", someone_else_writes_first)
    with pytest.raises(EDSDError, match="out: already exists|appeared while the output was being written"):
        convert(training_ckpt, dst)
    assert sorted(p.name for p in dst.iterdir()) == ["theirs.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"], "scratch left behind"


def test_force_checks_what_it_replaces_at_the_rename(training_ckpt, tmp_path):
    """--force accepted DST when it started; by the rename a user's directory is there instead."""
    dst = tmp_path / "out"
    convert(training_ckpt, dst)

    def swapped():
        dst.rename(tmp_path / "moved")
        dst.mkdir()
        (dst / "notes.txt").write_text("keep me")

    with pytest.raises(EDSDError, match="refusing to replace it with --force"):
        convert(training_ckpt, dst, force=True, progress=_during_conversion(swapped))
    assert (dst / "notes.txt").read_text() == "keep me" and sorted(p.name for p in dst.iterdir()) == ["notes.txt"]


def test_leftovers_of_a_killed_run_are_removed_and_never_taken_for_a_drafter(training_ckpt, tmp_path, capsys):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    partial = tmp_path / f".out.partial-{int(dead.stdout)}-0123456789ab"
    partial.mkdir()
    (partial / "config.json").write_text("{}")
    dst = tmp_path / "out"
    dst.mkdir()  # a config.json written before its weights (an interrupted writer)
    (dst / "config.json").write_text(json.dumps({"edsd_config": {"converter": {"name": "vllm-edsd"}}}))
    code, err = run_convert(capsys, training_ckpt, dst)
    assert code == 2 and "unfinished output" in err
    assert run_convert(capsys, training_ckpt, dst, "--force")[0] == 0
    assert not partial.exists()
    assert {p.name for p in dst.iterdir()} == {"config.json", "model.safetensors"}


def test_outputs_follow_the_umask(training_ckpt, tmp_path):
    old = os.umask(0o022)
    try:
        convert(training_ckpt, tmp_path / "out")
    finally:
        os.umask(old)
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o755
    assert all(f.stat().st_mode & 0o777 == 0o644 for f in (tmp_path / "out").iterdir())


def _deep(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize(("edit", "expected"), [
    (lambda c: c.update(rope_parameters=[1, 2]), "field 'rope_parameters' must be an object"),
    (lambda c: c.update(rope_scaling="yes", rope_parameters=None), "field 'rope_scaling' must be an object"),
    (lambda c: c["edsd_config"].update(target={"vocab_size": "x", "hidden_size": 256}),
     "field 'vocab_size' must be a positive integer, got 'x'"),
    (lambda c: c["edsd_config"].update(target=[512, 256]), "field 'edsd_config.target': must be an object"),
    (lambda c: c.update(rms_norm_eps=float("inf")), "field 'rms_norm_eps' must be below 2**31"),
    (lambda c: c.update(rms_norm_eps=float("nan")), "field 'rms_norm_eps' must be a positive number, got nan"),
    (lambda c: c.update(intermediate_size=2**40), "field 'intermediate_size' must be below 2**31"),
    (lambda c: c["edsd_config"].update(token_norm_folded=True, attention_reads_token=True),
     "edsd_config has both token_norm_folded and attention_reads_token"),
])
def test_malformed_config_fields_are_one_line(training_ckpt, tmp_path, capsys, edit, expected):
    src = edited_copy(training_ckpt, tmp_path / "src", edit_config=edit)
    one_line_refusal(capsys, src, tmp_path / "out", expected)


@pytest.mark.parametrize(("text", "expected"), [
    (_deep(100_000), "nested too deeply"),
    ('{"hidden_size": ' + "9" * 5000 + "}", "invalid JSON"),
])
def test_unreadable_json_is_one_line(training_ckpt, tmp_path, capsys, text, expected):
    src = edited_copy(training_ckpt, tmp_path / "src")
    (src / "config.json").write_text(text)
    one_line_refusal(capsys, src, tmp_path / "out", expected)


def _sharded(src: Path, dst: Path, weight_map) -> Path:
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    save_file(load_file(src / "model.safetensors"), dst / "model-1.safetensors")
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return dst


@pytest.mark.parametrize(("shard", "expected"), [
    ("../x.safetensors", "shard '../x.safetensors' is outside the checkpoint's directory"),
    ("ABSOLUTE", "is outside the checkpoint's directory"),
    (["model-1.safetensors"], "not a valid safetensors index ('weight_map' must map"),
    (7, "not a valid safetensors index ('weight_map' must map"),
])
def test_sharded_index_stays_in_its_directory(training_ckpt, tmp_path, capsys, shard, expected):
    save_file(load_file(training_ckpt / "model.safetensors"), tmp_path / "x.safetensors")
    shard = str(tmp_path / "x.safetensors") if shard == "ABSOLUTE" else shard
    names = list(load_file(training_ckpt / "model.safetensors"))
    weight_map = shard if isinstance(shard, list) else {name: shard for name in names}
    src = _sharded(training_ckpt, tmp_path / "src", weight_map)
    one_line_refusal(capsys, src, tmp_path / "out", expected)


def test_convert_records_relative_provenance(training_ckpt, tmp_path):
    convert(training_ckpt, tmp_path / "out")
    source = json.loads((tmp_path / "out" / "config.json").read_text())["edsd_config"]["source"]
    assert source["path"] == f"{training_ckpt.parent.name}/{training_ckpt.name}"


def test_target_embedding_is_the_only_tensor_read(models, training_ckpt, tmp_path, capsys):
    """A sharded target whose other shard is unreadable: folding needs the embedding only."""
    target = tmp_path / "target"
    target.mkdir()
    for f in Path(models["llama"]).iterdir():
        if f.name != "model.safetensors":
            (target / f.name).write_bytes(f.read_bytes())
    tensors = load_file(Path(models["llama"]) / "model.safetensors")
    embedding = "model.embed_tokens.weight"
    save_file({embedding: tensors[embedding]}, target / "model-embed.safetensors")
    (target / "a-other.safetensors").write_bytes(b"not a safetensors file")
    weight_map = {name: "model-embed.safetensors" if name == embedding else "a-other.safetensors" for name in tensors}
    (target / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    code, err = run_convert(capsys, training_ckpt, tmp_path / "out", "--target", target, "--fold-token-norm")
    assert code == 0, err
