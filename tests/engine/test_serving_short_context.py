"""A target with a 1,024-token context through the whole flow, every engine vLLM: ``edsd
regenerate`` (a prompt that does not fit ends its conversation, counted), ``edsd train`` under
``torchrun --nproc-per-node 2`` with vLLM's feature extraction (the training length follows the
target: 1,023 tokens, a longer sample cut and counted), and ``edsd convert``. An extraction
engine that asks for more tokens than the target holds (2,049) dies in vLLM's config validation
on every rank.
Lengths the target cannot hold, given by hand, are refused before any engine:
``tests/unit/test_checkpoint_targets.py``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support.engine_runs import in_process_core
from support.toy import make_target, toy_corpus

from vllm_edsd.launch.server import free_port

CONTEXT = 1024
PROMPTS = 90  # with the long sample, more than the 64 samples of one feature shard: one shard per rank
EDSD = (sys.executable, "-m", "vllm_edsd")
EAGER = ("--vllm-args", json.dumps({"enforce_eager": True}))  # every engine without torch.compile


def edsd(*args: str, launcher: tuple[str, ...] = EDSD, env: dict[str, str] | None = None) -> str:
    """An ``edsd`` command in its own process(es) (in ``env``, else this one's); its output, or the
    test fails with it."""
    env = {**(env or os.environ), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([*launcher, *args], capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout + done.stderr


def words(tokens: int) -> str:
    """About ``tokens`` tokens of the toy corpus, over and over (2.3 characters a token)."""
    text = " ".join(toy_corpus().split()) + " "
    return (text * (3 * tokens // len(text) + 1))[: int(2.3 * tokens)]


@pytest.fixture(scope="module")
def flow(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("short-context")
    target = str(make_target(root / "target", max_position_embeddings=CONTEXT))
    lines = [line for line in toy_corpus().splitlines() if line.strip()]
    pairs = [(a, b) for k in (1, 2, 3) for a, b in zip(lines, lines[k:])][:PROMPTS]
    prompts = [[{"role": "user", "content": f"{a} {b}"}] for a, b in pairs]
    (root / "prompts.jsonl").write_text("".join(json.dumps({"messages": p}) + "\n" for p in
                                                [*prompts, [{"role": "user", "content": words(2000)}]]))
    regenerated = edsd("regenerate", target, "--out", str(root / "answers.jsonl"), "--data",
                       str(root / "prompts.jsonl"), "--answer-tokens", "8", *EAGER, env=in_process_core())
    long_answer = [{"role": "user", "content": "Tell me everything."}, {"role": "assistant", "content": words(1500)}]
    with open(root / "answers.jsonl", "a") as data:
        data.write(json.dumps({"messages": long_answer}) + "\n")
    torchrun = (sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                str(free_port()), "-m", "vllm_edsd")
    trained = edsd("train", target, "--out", str(root / "run"), "--data", str(root / "answers.jsonl"), "--layers",
                   "1,3", "--epochs", "1", "--ttt-steps", "2", "--batch-size", "8", "--draft-vocab-size", "256",
                   "--device", "cpu", "--features-backend", "vllm", *EAGER, launcher=torchrun)
    converted = edsd("convert", str(root / "run" / "final"), str(root / "drafter"), "--target", target)
    return {"root": root, "regenerated": regenerated, "trained": trained, "converted": converted}


def test_regeneration_skips_the_prompt_that_does_not_fit(flow):
    assert (f"regeneration: 1 conversation ends before a turn whose prompt leaves no room for an answer in the "
            f"target's {CONTEXT} tokens; those left without any answer are dropped") in flow["regenerated"]
    assert f"regenerate: {PROMPTS} of {PROMPTS + 1} conversations answered by the target" in flow["regenerated"]


def test_training_follows_the_targets_context_under_torchrun(flow):
    """Two ranks, features through vLLM (an engine of 1,024 tokens), the long sample cut to the
    1,023 tokens the extraction can take and counted in one line."""
    log = flow["trained"]
    cut = re.search(rf"cut 1 of (\d+) samples to their first {CONTEXT - 1} tokens \(the target's context, {CONTEXT} "
                    r"tokens, less one\)", log)
    assert cut and int(cut[1]) > 64, log[-3000:]
    assert "2 data-parallel processes (ddp)" in log and "done: 1 epochs" in log
    assert "checked: vocab 512, hidden 256, 4 layers" in flow["converted"]
    assert (Path(flow["root"]) / "drafter" / "model.safetensors").is_file()
