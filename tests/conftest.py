"""Shared fixtures: tiny models built on the spot and real vLLM engines run as jobs.

vLLM engine start-up costs ~35 s on the CI machine, so each engine configuration is
started once per session (session-scoped fixtures) and every test that needs it reads the
job's recorded results.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specforge_layout import write_specforge_checkpoint
from vllm_edsd.acceptance import replay, total
from vllm_edsd.formats.config import LAYERNORM, RMSNORM
from vllm_edsd.formats.layouts import EDSD_TRAINING
from vllm_edsd.toy import make_drafter, make_target
from weights_convert import convert

HERE = Path(__file__).parent
ENGINE_TIMEOUT_S = int(os.environ.get("EDSD_TEST_ENGINE_TIMEOUT", "900"))
CONSTANT_DRAFT_VOCAB = 64

# Eight prompts of different lengths; token ids of the toy tokenizer's vocabulary.
PROMPTS = [[1, *range(10 + 7 * i, 10 + 7 * i + 3 + i)] for i in range(8)]


def run_engine_job(job: dict, workdir: Path, env: dict | None = None) -> dict:
    """Run ``engine_job.py`` on ``job``; fail the test with the engine's log on error."""
    workdir.mkdir(parents=True, exist_ok=True)
    job_file, out_file, log_file = workdir / "job.json", workdir / "out.json", workdir / "engine.log"
    job_file.write_text(json.dumps(job))
    full_env = {**os.environ, "VLLM_ALLOW_INSECURE_SERIALIZATION": "1", **(env or {})}
    with open(log_file, "w") as log:
        proc = subprocess.run(
            [sys.executable, str(HERE / "engine_job.py"), str(job_file), str(out_file)],
            stdout=log, stderr=subprocess.STDOUT, env=full_env, timeout=ENGINE_TIMEOUT_S,
        )
    if proc.returncode != 0:
        tail = log_file.read_text()[-6000:]
        pytest.fail(f"engine job failed (exit {proc.returncode}); log tail:\n{tail}")
    return json.loads(out_file.read_text())


def simulate_constant_drafter(outputs: list[list[int]], token: int, k: int) -> tuple[int, list[int]]:
    """Drafts and accepted-per-position of a drafter that always proposes ``token``."""
    counters = total([replay(out, 0, k, lambda c: [token] * k) for out in outputs])
    return counters.drafts, counters.accepted_per_pos


def edited_copy(src, dst: Path, edit_config=None, edit_tensors=None) -> Path:
    """A copy of a drafter directory with its config.json and/or tensors edited in place."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    if edit_config:
        cfg = json.loads((dst / "config.json").read_text())
        edit_config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    if edit_tensors:
        tensors = load_file(dst / "model.safetensors")
        edit_tensors(tensors)
        save_file(tensors, dst / "model.safetensors")
    return dst


def engine_config(target: str, spec: dict):
    """vLLM's own config path for a speculative config (no engine is started)."""
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=target, speculative_config=spec, gpu_memory_utilization=0.25).create_engine_config()


def edsd_spec(drafter, k: int = 4, **extra) -> dict:
    return {"method": "edsd", "model": str(drafter), "num_speculative_tokens": k, **extra}


def assert_drafts_match(prompts: list[list[int]], phase: dict, chains_for, k: int) -> int:
    """Every chain vLLM drafted in a recorded phase (one request at a time) equals
    ``chains_for(sequence)[p]``, the chain drafted from the context that ends at index p+1 of
    ``prompt + output``: first and fed-back draft steps. Returns how many chains matched."""
    import torch

    compared = 0
    for prompt, output, recorded in zip(prompts, phase["outputs"], phase["proposals"]):
        chains = chains_for(torch.tensor([prompt + output]))
        context = len(prompt) + 1  # prompt plus the token sampled at prefill
        for step in recorded:
            assert len(step) == 1, "one request at a time"
            draft = step[0]
            assert draft == chains[context - 2].tolist(), f"step at context length {context}"
            compared += 1
            accepted = 0
            while (accepted < k and context + accepted < len(prompt) + len(output)
                   and draft[accepted] == output[context - len(prompt) + accepted]):
                accepted += 1
            context += accepted + 1
    return compared


def greedy_phase(name: str = "greedy", prompts: list | None = None, max_tokens: int = 48, **extra) -> dict:
    return {
        "name": name,
        "prompts": prompts or PROMPTS,
        "sampling": {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True},
        **extra,
    }


def most_frequent_greedy_token(target_dir: Path, limit: int) -> int:
    """The token (below ``limit``) the target emits most often in greedy continuations of
    PROMPTS: the constant drafter proposes it, so its acceptance is non-zero."""
    from collections import Counter

    import torch

    from vllm_edsd.target import load_target

    model = load_target(target_dir)
    counts: Counter = Counter()
    for prompt in PROMPTS:
        out = model.generate(torch.tensor([prompt]), max_new_tokens=48, do_sample=False)
        counts.update(t for t in out[0, len(prompt):].tolist() if t < limit)
    return counts.most_common(1)[0][0]


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> dict:
    """Toy targets (Llama, Qwen3) and EDSD drafters for them, in vLLM's layout."""
    root = tmp_path_factory.mktemp("models")
    paths = {
        "llama": make_target(root / "llama", arch="llama"),
        "qwen3": make_target(root / "qwen3", arch="qwen3", seed=1),
        # A target of another width: drafters for it do not fit the others.
        "llama-narrow": make_target(root / "llama-narrow", hidden_size=128, num_heads=2, num_kv_heads=1),
    }
    # The main drafter takes the user's path: training layout, then `edsd convert`.
    make_drafter(paths["llama"], root / "llama-edsd-training", draft_vocab_size=256, aux_layer_ids=(1, 3), layout=EDSD_TRAINING)
    convert(root / "llama-edsd-training", root / "llama-edsd", target=paths["llama"])
    constant = most_frequent_greedy_token(paths["llama"], 512 - CONSTANT_DRAFT_VOCAB)
    make_drafter(
        paths["llama"], root / "llama-edsd-constant", draft_vocab_size=CONSTANT_DRAFT_VOCAB, constant_token=constant
    )
    make_drafter(paths["qwen3"], root / "qwen3-edsd", draft_vocab_size=384, aux_layer_ids=(2, 4), seed=2)
    paths.update({name: root / name for name in ("llama-edsd", "llama-edsd-constant", "qwen3-edsd")})
    return {**{k: str(v) for k, v in paths.items()}, "constant_token": constant}


@pytest.fixture(scope="session")
def parity_drafters(models, tmp_path_factory) -> dict:
    """Drafters whose drafts depend on every weight (random, token norms too), one per token
    norm, each converted unfolded and folded: ``{(norm, folded): (served dir, source dir)}``.
    The RMSNorm one is a SpecForge checkpoint (sharded, with its own copy of the embedding),
    the LayerNorm one this project's training layout."""
    root = tmp_path_factory.mktemp("parity")
    specforge = root / "specforge" / "epoch_0_step_100"
    write_specforge_checkpoint(models["llama"], specforge, sharded=True, with_embedding=True, seed=3)
    layernorm = root / "layernorm-training"
    make_drafter(models["llama"], layernorm, draft_vocab_size=256, token_norm=LAYERNORM, layout=EDSD_TRAINING, seed=4)
    drafters = {}
    for norm, source in ((RMSNORM, specforge), (LAYERNORM, layernorm)):
        for folded in (False, True):
            served = root / f"{norm}-{'folded' if folded else 'unfolded'}"
            convert(source, served, target=models["llama"], fold_token_norm=folded)
            drafters[norm, folded] = (str(served), str(source))
    return drafters


@pytest.fixture(scope="session")
def engine_runs(tmp_path_factory):
    """Memoised engine jobs: ``engine_runs(key, job)`` runs each key once per session."""
    cache: dict[str, dict] = {}
    root = tmp_path_factory.mktemp("engines")

    def run(key: str, job: dict, env: dict | None = None) -> dict:
        if key not in cache:
            cache[key] = run_engine_job(job, root / key, env)
        return cache[key]

    return run


@pytest.fixture(scope="session")
def baseline(models, engine_runs):
    """Greedy outputs of each toy target without speculation."""

    def outputs(arch: str) -> list[list[int]]:
        job = {"target": models[arch], "llm_kwargs": {"enforce_eager": True, "dtype": "float32"}, "phases": [greedy_phase()]}
        return engine_runs(f"baseline-{arch}", job)["phases"]["greedy"]["outputs"]

    return outputs
