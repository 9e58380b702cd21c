"""Data-parallel training under torchrun (``training/distributed.py``): two gloo ranks on the
CPU, with DDP and with FSDP, against one process, checkpoints written by rank 0 alone, resume,
and refused setups."""

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
from vllm_edsd.launch.server import free_port
from vllm_edsd.training import cli as train_cli
from vllm_edsd.training.fitter import Fitter
from vllm_edsd.training.job import prepare
from vllm_edsd.training.trainer import count_batches, epoch_batches

RANKS = 2
LR = 3e-3
RUN = ("--layers", "1,3", "--epochs", "2", "--ttt-steps", "2")  # 8 optimizer steps
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
# Kills rank 0 (or the one process) as it is about to create the directory EDSD_DIE_AT, or to
# write the training state for the EDSD_DIE_AT_SAVE-th time: interruptions at known points.
INTERRUPT = """\
if os.environ.get("RANK", "0") == "0" and (os.environ.get("EDSD_DIE_AT") or os.environ.get("EDSD_DIE_AT_SAVE")):
    saves = [0]
    def die(event, args, at=os.environ.get("EDSD_DIE_AT"), nth=int(os.environ.get("EDSD_DIE_AT_SAVE") or 0)):
        if event == "os.mkdir" and str(args[0]) == at:
            os._exit(1)
        if event == "os.rename" and str(args[1]).endswith("training_state.pt"):  # os.replace raises it
            saves[0] += 1
            if saves[0] == nth:
                os._exit(1)
    sys.addaudithook(die)
"""
# Records a rank that reaches the interpreter's teardown while torch's gloo worker threads run:
# one of them releasing a collective's tensors then cannot take the GIL and aborts the rank.
TEARDOWN_PROBE = """\
import atexit
def gloo_at_teardown(log=os.environ.get("EDSD_TEARDOWN_LOG")):
    threads = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    if log and "pt_gloo_runloop" in threads:
        with open(log, "a") as f:
            f.write(f"rank {os.environ['RANK']}: {sorted(threads)}\\n")
if os.environ.get("RANK"):
    atexit.register(gloo_at_teardown)
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    """The toy Llama target and 72 conversations: two feature shards (64 and 8 samples), one
    per rank; 4 optimizer steps per epoch (rank 1's batches of 2, rank 0 stops there)."""
    root = tmp_path_factory.mktemp("torchrun")
    lines = toy_corpus().splitlines()
    convs = [{"conversations": [{"from": "human", "value": a}, {"from": "gpt", "value": b}]}
             for k in (1, 2, 3) for a, b in zip(lines, lines[k:])][:72]
    (root / "chat.json").write_text(json.dumps(convs))
    (root / "hook").mkdir()
    (root / "hook" / "sitecustomize.py").write_text(WRITE_AUDIT + INTERRUPT + TEARDOWN_PROBE)
    return {"target": str(make_target(root / "llama")), "data": str(root / "chat.json"), "root": root}


def train_args(setup: dict, out: Path, *extra) -> list[str]:
    return ["train", setup["target"], "--out", str(out), "--data", setup["data"],
            "--cache", str(setup["root"] / "cache"), "--draft-vocab-size", "256",
            "--lr", str(LR), "--batch-size", "2", "--device", "cpu", "--features-backend", "transformers",
            *map(str, extra)]


def run_env(setup: dict, out: Path, die_at: Path | None = None, die_at_save: int | None = None) -> dict:
    """The environment of a run under the hooks (``WRITE_AUDIT``, ``INTERRUPT``, ``TEARDOWN_PROBE``)."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1",
            "EDSD_DIE_AT": str(die_at or ""), "EDSD_DIE_AT_SAVE": str(die_at_save or ""),
            "EDSD_AUDIT_UNDER": str(out), "EDSD_AUDIT_LOG": str(out.parent / "audit"),
            "EDSD_TEARDOWN_LOG": str(out.parent / "teardown"),
            "PYTHONPATH": os.pathsep.join([str(setup["root"] / "hook"), *sys.path])}


def torchrun(setup: dict, out: Path, *extra, **interrupt) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node 2 -m vllm_edsd train ...``, each rank's output in OUT-ranks/;
    ``interrupt`` (``die_at``, ``die_at_save``) kills rank 0 at a known point (``INTERRUPT``).
    No rank may reach the interpreter's teardown with gloo's threads running (``TEARDOWN_PROBE``):
    that aborted a finished rank now and then (SIGABRT, docs/scale.md)."""
    env = run_env(setup, out, **interrupt)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(RANKS),
           "--master-port", str(free_port()),  # not torchrun's fixed default: other runs may be beside it
           "--log-dir", str(out) + "-ranks", "--redirects", "3", "-m", "vllm_edsd", *train_args(setup, out, *extra)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    teardown = Path(env["EDSD_TEARDOWN_LOG"])
    assert not teardown.exists(), f"a rank tore down its interpreter with gloo running:\n{teardown.read_text()}"
    return done


def rank_output(out: Path, rank: int) -> str:
    return "".join(p.read_text() for p in Path(str(out) + "-ranks").glob(f"*/attempt_0/{rank}/std*.log"))


def finished_run(setup: dict, name: str, *extra) -> Path:
    """A two-rank run of ``RUN`` in its own directory (its audit log beside it)."""
    out = setup["root"] / name / "run"
    out.parent.mkdir()
    done = torchrun(setup, out, *RUN, *extra)
    assert done.returncode == 0, "\n".join([done.stderr[-2000:], *(rank_output(out, r)[-3000:] for r in range(RANKS))])
    return out


@pytest.fixture(scope="module")
def ddp_run(setup) -> Path:
    return finished_run(setup, "ddp")


@pytest.fixture(scope="module")
def fsdp_run(setup) -> Path:
    return finished_run(setup, "fsdp", "--data-parallel", "fsdp")


@pytest.fixture(scope="module")
def one_process(setup) -> dict[str, torch.Tensor]:
    """The weights one process ends with stepping on the union of both ranks' batch i (size
    2b, the real ``ttt_loss`` and optimizer step) for ``RUN``'s 8 AdamW steps."""
    out = setup["root"] / "one"
    job = prepare(train_cli.options(build_parser("train").parse_args(train_args(setup, out, *RUN))))
    fitter, b = Fitter(job.model, job.draft_head, job.recipe), job.recipe.batch_size
    generators = [torch.Generator().manual_seed(job.recipe.seed + rank) for rank in range(RANKS)]
    steps = min(count_batches(job.shards[rank::RANKS], b) for rank in range(RANKS))
    for epoch in range(job.recipe.epochs):
        for i, batch in enumerate(epoch_batches(job.shards, b, generators, job.columns, list(range(RANKS)), RANKS,
                                                steps)):
            assert batch["input_ids"].shape[0] == RANKS * b
            lr = job.recipe.learning_rate(epoch * steps + i, job.recipe.epochs * steps)
            fitter.step(batch, job.recipe.steps(epoch), job.recipe.percent(epoch), lr)
    job.model.save_pretrained(out)
    return load_file(out / "model.safetensors")


def assert_trained_as_one_process(run: Path, one_process: dict[str, torch.Tensor]) -> None:
    """Every weight of the run's final checkpoint within lr/100 of one process's."""
    final = load_file(run / "final" / "model.safetensors")
    assert final.keys() == one_process.keys()
    for name in final:
        assert (final[name].double() - one_process[name].double()).abs().max() <= LR / 100, name


def assert_rank_0_alone_wrote(run: Path) -> None:
    assert "done: 2 epochs" in rank_output(run, 0) and rank_output(run, 1) == ""
    assert not (run.parent / "audit").exists(), (run.parent / "audit").read_text()


def test_ddp_equals_one_process_on_the_union_batch(setup, ddp_run, one_process):
    """Two gloo ranks with batch size b train the same drafter as one process stepping on the
    union of both ranks' batch i: every weight within lr/100 (3e-5) of the reference. The
    gradients agree to float32 rounding (summation order: all_reduce, batched products); AdamW
    divides by the gradient's RMS, so that rounding moves an element whose gradient is near 0
    by a fraction of lr (5e-6 seen), while per-rank instead of global loss normalisation is off
    by 4e-2. Also: rank 1 printed nothing and wrote nothing under the run directory; a rerun of
    the finished run resumes from its state and ends at once."""
    log = [json.loads(line) for line in (ddp_run / "train_log.jsonl").read_text().splitlines()]
    assert [e["n_t"] for e in log] == [1, 2] and log[0]["masked_fraction"] > 0
    assert_rank_0_alone_wrote(ddp_run)
    assert_trained_as_one_process(ddp_run, one_process)
    ddp = load_file(ddp_run / "final" / "model.safetensors")
    rerun = torchrun(setup, ddp_run, *RUN)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert "after epoch 1" in rank_output(ddp_run, 0) and rank_output(ddp_run, 1) == ""
    again = load_file(ddp_run / "final" / "model.safetensors")
    assert all(torch.equal(ddp[k], again[k]) for k in ddp)


def tensor_kinds(tensors: dict) -> dict[str, tuple]:
    """Name -> (shape, dtype) of every tensor in a (nested) state dict; plain values as they are."""
    kinds = {}
    for key, value in tensors.items():
        if isinstance(value, dict):
            kinds.update({f"{key}.{k}": v for k, v in tensor_kinds(value).items()})
        else:
            kinds[str(key)] = (tuple(value.shape), value.dtype) if isinstance(value, torch.Tensor) else value
    return kinds


def test_fsdp_equals_one_process_and_writes_what_ddp_writes(ddp_run, fsdp_run, one_process):
    """``--data-parallel fsdp`` (FSDP2 over gloo): the weights of one process on the union
    batch within lr/100, as DDP's (sharding the forward methods wrongly or averaging the loss
    per rank would not be); every checkpoint has DDP's files, config and tensor names, shapes
    and dtypes, and the training state DDP's keys and full tensors (only its ``data_parallel``
    differs): they convert and serve alike."""
    assert "2 data-parallel processes (fsdp)" in rank_output(fsdp_run, 0)
    assert_rank_0_alone_wrote(fsdp_run)
    assert_trained_as_one_process(fsdp_run, one_process)
    for checkpoint in ("epoch_0", "epoch_1", "final"):
        ours, theirs = fsdp_run / checkpoint, ddp_run / checkpoint
        assert sorted(p.name for p in ours.iterdir()) == sorted(p.name for p in theirs.iterdir())
        assert json.loads((ours / "config.json").read_text()) == json.loads((theirs / "config.json").read_text())
        kinds = [tensor_kinds(load_file(d / "model.safetensors")) for d in (ours, theirs)]
        assert kinds[0] == kinds[1]
    states = [torch.load(run / "training_state.pt", weights_only=True) for run in (fsdp_run, ddp_run)]
    assert [state.pop("data_parallel") for state in states] == ["fsdp", "ddp"]
    for state in states:
        state.pop("log")  # wall times
        state.pop("ranks")  # generator states, compared as a whole below
    ours, theirs = (tensor_kinds({k: v for k, v in s.items() if k in ("model", "optimizer")}) for s in states)
    assert ours == theirs and any(key.startswith("optimizer.state.midlayer.") for key in ours)


def test_interrupted_fsdp_run_resumes_to_the_uninterrupted_result(setup, fsdp_run, tmp_path):
    """An FSDP run whose rank 0 dies as it writes the second epoch's checkpoint, rerun: it
    resumes after the first epoch (each rank's shards of the saved weights and AdamW state)
    and ends with the uninterrupted run's tensors exactly."""
    cut = tmp_path / "cut"
    died = torchrun(setup, cut, *RUN, "--data-parallel", "fsdp", die_at=cut / "epoch_1")
    assert died.returncode != 0
    assert torch.load(cut / "training_state.pt", weights_only=True)["epoch"] == 0
    assert not (cut / "epoch_1").exists() and not (cut / "final").exists()
    resumed = torchrun(setup, cut, *RUN, "--data-parallel", "fsdp")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "after epoch 0" in rank_output(cut, 0)
    a, b = (load_file(run / "final" / "model.safetensors") for run in (fsdp_run, cut))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("ranks", [1, RANKS])
def test_run_saved_mid_epoch_resumes_to_the_uninterrupted_result(setup, ddp_run, tmp_path, ranks):
    """``--save-every 1`` saves the training state after every batch. A run whose rank 0 (or
    one process) dies as it writes the state the third time holds it 2 batches into the first
    epoch; rerun, it resumes there (each rank's shuffling, RNG states and sums so far) and ends
    with the tensors and log of a run never interrupted that saved after each epoch only (for
    two ranks ``ddp_run``)."""

    def run(out: Path, *extra, **interrupt) -> subprocess.CompletedProcess:
        if ranks > 1:
            return torchrun(setup, out, *RUN, *extra, **interrupt)
        return subprocess.run([sys.executable, "-m", "vllm_edsd", *train_args(setup, out, *RUN, *extra)],
                              env=run_env(setup, out, **interrupt), capture_output=True, text=True, timeout=300)

    whole = ddp_run
    if ranks == 1:  # as the cut run, in a process with one thread: the same float rounding
        whole = tmp_path / "whole"
        assert run(whole).returncode == 0
    cut = tmp_path / "cut"
    assert run(cut, "--save-every", 1, die_at_save=3).returncode != 0
    state = torch.load(cut / "training_state.pt", weights_only=True)
    assert (state["epoch"], state["batches"]) == (-1, 2) and not (cut / "epoch_0").exists()
    trained_before = state["wall_s"]
    resumed = run(cut, "--save-every", 1)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "2 batches into epoch 1" in (rank_output(cut, 0) if ranks > 1 else resumed.stdout)
    a, b = (load_file(r / "final" / "model.safetensors") for r in (whole, cut))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    logs = [[{k: v for k, v in json.loads(line).items() if k != "wall_s"}
             for line in (r / "train_log.jsonl").read_text().splitlines()] for r in (whole, cut)]
    assert logs[0] == logs[1]
    # the resumed epoch's wall time counts its batches trained before the interruption too
    assert json.loads((cut / "train_log.jsonl").read_text().splitlines()[0])["wall_s"] > trained_before > 0


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
    assert ("holds a run of 2 training process(es) (torchrun --nproc-per-node 2 -m vllm_edsd train --data-parallel "
            "ddp ...); resume it with as many and the same --data-parallel") in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(train_args(setup, tmp_path / "x", "--layers", "1,3", "--device", "cuda")) == 2
        assert "CUDA is not available here" in capsys.readouterr().err
    for key, value in {"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "no-such-host.invalid",
                       "MASTER_PORT": "29999"}.items():
        monkeypatch.setenv(key, value)
    assert main(train_args(setup, tmp_path / "x", "--layers", "1,3")) == 2
    err = capsys.readouterr().err
    assert "MASTER_ADDR 'no-such-host.invalid': unknown host" in err and "Traceback" not in err
