"""Data-parallel training under torchrun (``training/distributed.py``): two gloo ranks on the
CPU against one process, checkpoints written by rank 0 alone, resume, and refused setups."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support.toy import make_target, toy_corpus

from vllm_edsd.cli import build_parser, main
from vllm_edsd.training.cli import prepare
from vllm_edsd.training.trainer import Fitter, count_batches, epoch_batches

RANKS = 2
# Records, for rank 1 only, every file it opens for writing, creates or renames under the run.
WRITE_AUDIT = """\
import os, sys
if os.environ.get("RANK") == "1" and os.environ.get("EDSD_AUDIT_UNDER"):
    under, log = os.environ["EDSD_AUDIT_UNDER"], os.environ["EDSD_AUDIT_LOG"]
    def audit(event, args):
        writes = event == "open" and isinstance(args[1], str) and any(c in args[1] for c in "wax+")
        if (writes or event in ("os.mkdir", "os.rename", "os.replace", "os.remove")) and str(args[0]).startswith(under):
            with open(log, "a") as f:
                f.write(f"{event} {args[0]}\\n")
    sys.addaudithook(audit)
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    """The toy Llama target and 72 conversations: two feature shards (64 and 8 samples), one
    per rank; 4 optimizer steps per epoch (rank 1's batches of 2, rank 0 stops there)."""
    root = tmp_path_factory.mktemp("ddp")
    lines = toy_corpus().splitlines()
    convs = [{"conversations": [{"from": "human", "value": a}, {"from": "gpt", "value": b}]}
             for k in (1, 2, 3) for a, b in zip(lines, lines[k:])][:72]
    (root / "chat.json").write_text(json.dumps(convs))
    (root / "hook").mkdir()
    (root / "hook" / "sitecustomize.py").write_text(WRITE_AUDIT)
    return {"target": str(make_target(root / "llama")), "data": str(root / "chat.json"), "root": root}


def train_args(setup: dict, out: Path, *extra) -> list[str]:
    return ["train", setup["target"], "--out", str(out), "--data", setup["data"],
            "--cache", str(setup["root"] / "cache"), "--draft-vocab-size", "256",
            "--lr", "3e-3", "--batch-size", "2", "--device", "cpu", "--features-backend", "transformers",
            *map(str, extra)]


def torchrun(setup: dict, out: Path, *extra) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node 2 -m vllm_edsd train ...``, each rank's output in OUT-ranks/."""
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "EDSD_AUDIT_UNDER": str(out), "EDSD_AUDIT_LOG": str(out.parent / "audit"),
           "PYTHONPATH": os.pathsep.join([str(setup["root"] / "hook"), *sys.path])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(RANKS),
           "--log-dir", str(out) + "-ranks", "--redirects", "3", "-m", "vllm_edsd", *train_args(setup, out, *extra)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def rank_output(out: Path, rank: int) -> str:
    return "".join(p.read_text() for p in Path(str(out) + "-ranks").glob(f"*/attempt_0/{rank}/std*.log"))


def test_ddp_equals_one_process_on_the_union_batch(setup, tmp_path):
    """Two gloo ranks with batch size b train the same drafter as one process stepping on the
    union of both ranks' batch i (size 2b, the real ``ttt_loss`` and optimizer step), over
    8 AdamW steps: every weight within lr/100 (3e-5) of the reference. The gradients agree to
    float32 rounding (summation order: all_reduce, batched products); AdamW divides by the
    gradient's RMS, so that rounding moves an element whose gradient is near 0 by a fraction
    of lr (5e-6 seen), while per-rank instead of global loss normalisation is off by 4e-2.
    Also: rank 1 printed nothing and wrote nothing under the run directory; a rerun of the
    finished run resumes from its state and ends at once."""
    out = tmp_path / "ddp"
    args = ("--layers", "1,3", "--epochs", "2", "--ttt-steps", "2")
    done = torchrun(setup, out, *args)
    assert done.returncode == 0, done.stderr[-2000:]
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [e["n_t"] for e in log] == [1, 2] and log[0]["masked_fraction"] > 0
    assert "done: 2 epochs" in rank_output(out, 0) and rank_output(out, 1) == ""
    assert not (tmp_path / "audit").exists(), (tmp_path / "audit").read_text()

    job = prepare(build_parser("train").parse_args(train_args(setup, tmp_path / "one", *args)))
    fitter, b = Fitter(job.model, job.draft_head, job.recipe), job.recipe.batch_size
    generators = [torch.Generator().manual_seed(job.recipe.seed + rank) for rank in range(RANKS)]
    steps = min(count_batches(job.shards[rank::RANKS], b) for rank in range(RANKS))
    for epoch in range(job.recipe.epochs):
        for batch in epoch_batches(job.shards, b, generators, job.columns, list(range(RANKS)), RANKS, steps):
            assert batch["input_ids"].shape[0] == RANKS * b
            fitter.step(batch, job.recipe.steps(epoch), job.recipe.percent(epoch))
    job.model.save_pretrained(tmp_path / "one")
    ddp = load_file(out / "final" / "model.safetensors")
    one = load_file(tmp_path / "one" / "model.safetensors")
    assert ddp.keys() == one.keys()
    for name in ddp:
        assert (ddp[name].double() - one[name].double()).abs().max() <= job.recipe.lr / 100, name
    rerun = torchrun(setup, out, *args)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert "after epoch 1" in rank_output(out, 0) and rank_output(out, 1) == ""
    again = load_file(out / "final" / "model.safetensors")
    assert all(torch.equal(ddp[k], again[k]) for k in ddp)


@pytest.mark.parametrize("method", ["eagle3", "specforge"])
def test_torchrun_trains_both_methods(setup, tmp_path, method):
    """The EAGLE-3 baseline and EDSD with the SpecForge reading train end to end on two ranks;
    rank 0 alone writes, and its state holds both ranks' shuffling and RNG states."""
    out = tmp_path / method
    args = (("--method", "eagle3", "--layers", "1,2,3") if method == "eagle3"
            else ("--layers", "1,3", "--edtrain-reading", "specforge"))
    done = torchrun(setup, out, *args, "--epochs", "2", "--ttt-steps", "2")
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(p.name for p in out.iterdir() if p.name != "cache") == [
        "epoch_0", "epoch_1", "final", "train_log.jsonl", "training_state.pt"]
    state = torch.load(out / "training_state.pt", weights_only=True)
    assert state["world_size"] == RANKS and len(state["ranks"]) == RANKS
    assert not torch.equal(state["ranks"][0]["generator"], state["ranks"][1]["generator"])
    assert not (tmp_path / "audit").exists(), (tmp_path / "audit").read_text()


def test_refused_setups(setup, tmp_path, capsys, monkeypatch):
    """One clear line each: a run of two resumed by one process, CUDA that is not there, a
    master that is not there."""
    run = tmp_path / "run"
    run.mkdir()
    torch.save({"recipe": {}, "model": {}, "optimizer": {}, "epoch": 0, "world_size": 2}, run / "training_state.pt")
    assert main(train_args(setup, run, "--layers", "1,3")) == 2
    assert "holds a run of 2 training process(es); resume it with as many" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(train_args(setup, tmp_path / "x", "--layers", "1,3", "--device", "cuda")) == 2
        assert "CUDA is not available here" in capsys.readouterr().err
    for key, value in {"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "no-such-host.invalid",
                       "MASTER_PORT": "29999"}.items():
        monkeypatch.setenv(key, value)
    assert main(train_args(setup, tmp_path / "x", "--layers", "1,3")) == 2
    err = capsys.readouterr().err
    assert "MASTER_ADDR 'no-such-host.invalid': unknown host" in err and "Traceback" not in err
