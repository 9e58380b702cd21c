"""The GPU tier of the training side (``bash scripts/test_gpu.sh`` on a CUDA machine; skipped
elsewhere): vLLM's own hidden-states connector (CUDA streams, pinned memory) against the
transformers path, and data-parallel training over NCCL, DDP and FSDP (two GPUs)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support.toy import toy_corpus

from vllm_edsd.features.shards import read_shard

pytestmark = pytest.mark.gpu

BF16_STEP = 2.0**-7  # the stored features are bfloat16; both paths run the target in float32
TORCHRUN = (sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "vllm_edsd")
LR = 3e-3  # the CPU test's (tests/engine/test_training_distributed.py): weights within lr/100 there
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL data parallelism needs two GPUs")


def edsd(*args: str, launcher: tuple[str, ...] = (sys.executable, "-m", "vllm_edsd")) -> str:
    done = subprocess.run([*launcher, *args], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """72 conversations: two feature shards, one per rank."""
    lines = [line for line in toy_corpus().splitlines() if line.strip()]
    pairs = [(a, b) for k in (1, 2, 3) for a, b in zip(lines, lines[k:])][:72]
    path = tmp_path_factory.mktemp("gpu-data") / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": a},
                                                     {"role": "assistant", "content": b}]}) + "\n"
                            for a, b in pairs))
    return path


def records(cache: Path) -> dict[tuple[int, ...], dict]:
    return {tuple(r["input_ids"].tolist()): r for shard in (cache / "features").glob("shard-*.safetensors")
            for r in read_shard(shard)}


def test_vllm_features_on_cuda_equal_the_transformers_ones(models, data, tmp_path):
    """On a GPU the plugin's connector is vLLM's own (its CUDA copy path) and the head runs on
    the GPU: the same stored features as transformers on the GPU."""
    common = ["--data", str(data), "--feature-layers", "1,3", "--max-length", "96", "--device", "cuda",
              "--dtype", "float32"]
    log = edsd("features", models["llama"], "--cache", str(tmp_path / "vllm"), "--features-backend", "vllm", *common)
    assert "target features (vllm):" in log
    edsd("features", models["llama"], "--cache", str(tmp_path / "hf"), "--features-backend", "transformers", *common)
    ours, theirs = records(tmp_path / "vllm"), records(tmp_path / "hf")
    assert ours.keys() == theirs.keys() and ours
    for tokens, record in ours.items():
        for key in ("aux", "final"):
            a, b = record[key].float(), theirs[tokens][key].float()
            assert torch.allclose(a, b, rtol=BF16_STEP, atol=BF16_STEP * float(b.abs().mean())), key


def train_args(models, data: Path, out: Path, *extra: str) -> list[str]:
    return ["train", models["llama"], "--out", str(out), "--data", str(data), "--layers", "1,3", "--epochs", "2",
            "--ttt-steps", "2", "--draft-vocab-size", "256", "--batch-size", "2", "--device", "cuda",
            "--features-backend", "transformers", *extra]


@two_gpus
def test_two_ranks_over_nccl_train_and_resume(models, data, tmp_path):
    out = tmp_path / "run"
    args = train_args(models, data, out)
    log = edsd(*args, launcher=TORCHRUN)
    assert "2 data-parallel processes" in log and (out / "final" / "config.json").is_file()
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert len(log) == 2 and all(entry["loss"] == entry["loss"] for entry in log)  # not NaN
    assert "resuming" in edsd(*args, launcher=TORCHRUN)  # the state both ranks saved is read back


@two_gpus
def test_fsdp_over_nccl_trains_what_ddp_trains_and_resumes(models, data, tmp_path):
    """``--data-parallel fsdp`` on two GPUs (FSDP2 over NCCL): the final checkpoint has DDP's
    tensor names, shapes and dtypes and its weights within lr/100 of DDP's (both equal one
    process on the union batch: tests/engine/test_training_distributed.py); the state is read back."""
    fsdp = train_args(models, data, tmp_path / "fsdp", "--lr", str(LR), "--data-parallel", "fsdp")
    ddp = train_args(models, data, tmp_path / "ddp", "--lr", str(LR))
    assert "2 data-parallel processes (fsdp)" in edsd(*fsdp, launcher=TORCHRUN)
    edsd(*ddp, launcher=TORCHRUN)
    ours, theirs = (load_file(tmp_path / run / "final" / "model.safetensors") for run in ("fsdp", "ddp"))
    assert ours.keys() == theirs.keys()
    for name, tensor in ours.items():
        assert (tensor.shape, tensor.dtype) == (theirs[name].shape, theirs[name].dtype), name
        assert (tensor.double() - theirs[name].double()).abs().max() <= LR / 100, name
    assert "resuming" in edsd(*fsdp, launcher=TORCHRUN)
