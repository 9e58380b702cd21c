"""EDTrain's real runs on the toy target, through ``edsd train``: both methods learn and reload,
an interrupted run resumes to the same weights, one feature extraction serves both methods, and
what a bad run directory or bad arguments get. Minutes on a CPU: they train, and one kills a
training process mid-run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from support.toy import toy_corpus

from vllm_edsd.cli import main
from vllm_edsd.methods.edsd.model import EDSDDraftModel


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
    from vllm_edsd.launch.transformers_target import load_target

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
    assert "EDSD needs its 2 aux layers" in capsys.readouterr().err
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
