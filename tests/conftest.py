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
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.shared import build_once, separate_worker_engines
from support.specforge_layout import specforge_chains, write_specforge_checkpoint
from support.toy import make_drafter, make_target, toy_corpus

from vllm_edsd.checkpoint.config import LAYERNORM, RMSNORM
from vllm_edsd.methods.edsd.layouts import EDSD_TRAINING
from vllm_edsd.training.acceptance import replay, total
from weights_convert import convert

HERE = Path(__file__).parent
ENGINE_TIMEOUT_S = int(os.environ.get("EDSD_TEST_ENGINE_TIMEOUT", "900"))
CONSTANT_DRAFT_VOCAB = 64
# Llama-3.1's RoPE scaling, with a short original context so that it changes most frequencies.
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}

# Eight prompts of different lengths; token ids of the toy tokenizer's vocabulary.
PROMPTS = [[1, *range(10 + 7 * i, 10 + 7 * i + 3 + i)] for i in range(8)]
# Six prompts, each one of two 257-token prefixes (two blocks of vLLM's CPU default of 128
# tokens, and one token more) and its own few tokens: once a prefix's first request has run,
# the prefix cache holds it for the others (tests/engine/test_prefix_caching.py).
SHARED_PREFIXES = [[1, *range(20, 276)], [1, *range(500, 244, -1)]]
SHARED_PREFIX_PROMPTS = [SHARED_PREFIXES[which] + list(range(280 + 10 * i, 285 + 11 * i))
                         for i, which in enumerate([0, 1, 0, 1, 1, 0])]
# Their draft-length caps one request at a time, in order: the first prefix first computed by a
# request that opted out of drafting, the second by a drafting one; then uncapped, capped and
# opted-out requests on both (an opted-out request's blocks serve only opted-out requests).
SHARED_PREFIX_CAPS = [0, None, None, 2, 0, 1]

separate_worker_engines()


def run_engine_job(job: dict, workdir: Path, env: dict | None = None) -> dict:
    """Run ``engine_job.py`` on ``job``; fail the test with the engine's log on error."""
    workdir.mkdir(parents=True, exist_ok=True)
    job_file, out_file, log_file = workdir / "job.json", workdir / "out.json", workdir / "engine.log"
    job_file.write_text(json.dumps(job))
    full_env = {**os.environ, "VLLM_ALLOW_INSECURE_SERIALIZATION": "1", **(env or {})}
    with open(log_file, "w") as log:
        proc = subprocess.run(
            [sys.executable, str(HERE / "support" / "engine_job.py"), str(job_file), str(out_file)],
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


def processes_with(marker: str) -> list[int]:
    """Pids of processes whose environment holds ``marker`` (vLLM's spawned engine processes
    inherit the server's environment, not its command line)."""
    pids = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if marker.encode() in (proc / "environ").read_bytes():
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


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


def drafting_steps(prompt: list[int], output: list[int], recorded: list) -> Iterator[tuple[int, list[int], int]]:
    """The draft steps of one recorded request (one request at a time): (context length,
    draft chain, drafts accepted). A draft is accepted where it equals the token the engine
    emitted (at temperature > 0 too: a rejected draft's replacement never equals it)."""
    context = len(prompt) + 1  # prompt plus the token sampled at prefill
    for step in recorded:
        assert len(step) == 1, "one request at a time"
        if context > len(prompt) + len(output):
            # drafted in the step that ended the request, after a token its output leaves out
            # (seen on a fresh 2-core EPYC at 44ceefc too): no step verified it
            break
        draft = step[0]
        accepted = 0
        while (accepted < len(draft) and context + accepted < len(prompt) + len(output)
               and draft[accepted] == output[context - len(prompt) + accepted]):
            accepted += 1
        yield context, draft, accepted
        context += accepted + 1


def draft_agreement(prompts: list[list[int]], phase: dict, chains_for) -> tuple[int, int]:
    """(draft tokens equal to ``chains_for``'s, draft tokens) over a recorded phase (one request
    at a time): where exact parity cannot hold, such as float16 against the float32 reference."""
    import torch

    same = total = 0
    for prompt, output, recorded in zip(prompts, phase["outputs"], phase["proposals"], strict=True):
        chains = chains_for(torch.tensor([prompt + output]))
        for context, draft, _accepted in drafting_steps(prompt, output, recorded):
            same += sum(a == b for a, b in zip(draft, chains[context - 2].tolist(), strict=True))
            total += len(draft)
    return same, total


def assert_drafts_match(prompts: list[list[int]], phase: dict, chains_for, k: int) -> int:
    """Every chain vLLM drafted in a recorded phase (one request at a time) equals
    ``chains_for(sequence)[p]``, the chain drafted from the context that ends at index p+1 of
    ``prompt + output`` (a tensor row, or a list where chains may be cut short): first and
    fed-back draft steps. Returns how many chains matched."""
    import torch

    compared = 0
    for prompt, output, recorded in zip(prompts, phase["outputs"], phase["proposals"]):
        chains = chains_for(torch.tensor([prompt + output]))
        for context, draft, _accepted in drafting_steps(prompt, output, recorded):
            expected = chains[context - 2]
            assert draft == (expected.tolist() if isinstance(expected, torch.Tensor) else expected), \
                f"step at context length {context}"
            compared += 1
    return compared


def reference_chains(target_dir: str, source: str, specforge: bool = False, k: int = 4):
    """``chains_for(sequence)``: the reference model's draft chains after every prefix of a
    sequence, the model loaded from ``source`` (for a SpecForge checkpoint, checked against
    SpecForge's own forward too)."""
    import torch
    from safetensors.torch import load_file

    from vllm_edsd.features.hidden_states import run_target
    from vllm_edsd.launch.transformers_target import load_target
    from vllm_edsd.methods.edsd.model import EDSDDraftModel

    target = load_target(target_dir)
    drafter = EDSDDraftModel.from_pretrained(source, embed_tokens=target.model.embed_tokens.weight)
    layers = drafter.config.aux_layer_ids

    def chains_for(sequence):
        features = run_target(target, sequence, layers).features(layers)[:, :-1]
        chains = drafter.propose(features, sequence[:, 1:], k)
        if specforge:
            checkpoint = {
                n: t for f in sorted(Path(source).glob("model*.safetensors")) for n, t in load_file(f).items()
            }
            config = json.loads((Path(source) / "config.json").read_text())
            embed = target.model.embed_tokens.weight
            assert torch.equal(specforge_chains(checkpoint, config, embed, features, sequence[:, 1:], k), chains)
        return chains[0]

    return chains_for


# Per-request draft-length caps (extra_args["num_speculative_tokens"]) for the eight prompts of
# ``trained``, with K=4: none, one, all, the engine's K (no cap) and between.
CAPS = [0, 1, 4, None, 0, 1, 4, 2]


def per_request_metrics() -> bool:
    """Whether this vLLM reports spec-decode metrics per request (0.32 does, 0.27 does not)."""
    from vllm.config import ObservabilityConfig

    return "per_request_spec_decode_metrics" in ObservabilityConfig.__dataclass_fields__


def llama_edsd_eager(models: dict, engine_runs) -> dict:
    """The toy Llama target with its EDSD drafter (K=4), eager and in float32 like the reference,
    vLLM's defaults otherwise (prefix caching on): PROMPTS (test_serving.py), then
    SHARED_PREFIX_PROMPTS one at a time with their caps (test_prefix_caching.py), every chain
    and each request's drafter forwards recorded."""
    job = {
        "target": models["llama"],
        "speculative_config": edsd_spec(models["llama-edsd"]),
        "llm_kwargs": {"enforce_eager": True, "dtype": "float32"},
        "phases": [greedy_phase(record_proposals=True),
                   {**capped_phase("shared-prefix", SHARED_PREFIX_PROMPTS, SHARED_PREFIX_CAPS, SHARED_PREFIX_TOKENS,
                                   alone=True), "count_drafter_forwards": True}],
    }
    return engine_runs("llama-edsd-eager", job)


def capped_phase(name: str, prompts: list, caps: list, max_tokens: int, alone: bool = False) -> dict:
    """A greedy phase with one cap per prompt (None: no cap), the whole batch at once, every
    draft step's rows recorded with their caps (``alone``: one request at a time, every chain
    recorded)."""
    phase = greedy_phase(name, prompts, max_tokens, **{"record_proposals" if alone else "record_batch": True})
    phase["sampling"] = [{**phase["sampling"], "extra_args": {} if cap is None else {"num_speculative_tokens": cap}}
                         for cap in caps]
    return phase


def greedy_phase(name: str = "greedy", prompts: list | None = None, max_tokens: int = 48, **extra) -> dict:
    return {
        "name": name,
        "prompts": prompts or PROMPTS,
        "sampling": {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True},
        **extra,
    }


FITTED_TOKENS = 40
SHARED_PREFIX_TOKENS = 24
MAX_MODEL_LEN = 256
# 10 blocks of 32 tokens (the CPU attention's block size is a multiple of 32) hold 320 tokens:
# eight FITTED_TOKENS requests on the fitted target start in about 10 blocks and grow to 19
# together, so the scheduler must preempt, while any one of them fits (vLLM refuses a cache
# that cannot hold max_model_len).
SMALL_CACHE = {"block_size": 32, "num_gpu_blocks_override": 10, "max_model_len": MAX_MODEL_LEN}
# The OpenAI server on the fitted target: float32 and eager like the reference.
SERVER_ARGS = ["--served-model-name", "toy", "--dtype", "float32", "--enforce-eager", "--max-model-len", "1024"]


def serve_fitted(trained: dict, engine_runs, key: str, spec: dict | None, eager: bool = True,
                 model: str | None = None) -> dict:
    """The greedy phase of an engine on the fitted target and ``trained["prompts"]``. ``model``
    is what vLLM is given instead of the target: a drafter directory served alone, which names
    the target itself (docs/formats.md, "Speculators format")."""
    job = {"target": model or trained["target"], "speculative_config": spec,
           "llm_kwargs": {"enforce_eager": eager, "dtype": "float32"},
           "phases": [greedy_phase(prompts=trained["prompts"], max_tokens=FITTED_TOKENS)]}
    return engine_runs(key, job)["phases"]["greedy"]


def predicted_counters(trained: dict, outputs: list[list[int]], k: int, max_entropy: float | None = None,
                       caps: list[int] | None = None):
    """What the reference model, loaded from the unfolded conversion of the trained drafter,
    predicts for these greedy outputs of ``trained["prompts"]`` (with ``max_entropy``: under
    the adaptive draft length; with ``caps``: each request's draft-length cap)."""
    from vllm_edsd.launch.transformers_target import load_target
    from vllm_edsd.methods.edsd.model import EDSDDraftModel
    from vllm_edsd.training.acceptance import predict

    target = load_target(trained["target"])
    drafter = EDSDDraftModel.from_pretrained(trained["edsd"], embed_tokens=target.model.embed_tokens.weight)
    return predict(drafter, target, list(zip(trained["prompts"], outputs)), k, max_entropy, caps)


def assert_counters_match(predicted, measured: dict) -> None:
    """vLLM's counters equal the reference's prediction up to argmax near-ties that float32
    rounding can flip between the reference and vLLM's kernels: 2% of the drafts per position
    (the parity tests show the chains themselves agree exactly). Over 5% of first drafts must
    be accepted (a random drafter: under 1%), so a drafter that proposes garbage cannot pass."""
    assert predicted.drafts == pytest.approx(measured["drafts"], rel=0.02)
    for p, m in zip(predicted.accepted_per_pos, measured["accepted_per_pos"], strict=True):
        assert abs(p - m) <= 0.02 * measured["drafts"] + 1, (predicted.accepted_per_pos, measured["accepted_per_pos"])
    assert measured["accepted_per_pos"][0] > 0.05 * measured["drafts"]


def most_frequent_greedy_token(target_dir: Path, limit: int) -> int:
    """The token (below ``limit``) the target emits most often in greedy continuations of
    PROMPTS: the constant drafter proposes it, so its acceptance is non-zero."""
    from collections import Counter

    import torch

    from vllm_edsd.launch.transformers_target import load_target

    model = load_target(target_dir)
    counts: Counter = Counter()
    for prompt in PROMPTS:
        out = model.generate(torch.tensor([prompt]), max_new_tokens=48, do_sample=False)
        counts.update(t for t in out[0, len(prompt):].tolist() if t < limit)
    return counts.most_common(1)[0][0]


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> dict:
    """Toy targets (Llama, Qwen3) and EDSD drafters for them, in vLLM's layout."""
    return build_once(tmp_path_factory, "models", build_models)


def build_models(root: Path) -> dict:
    paths = {
        "llama": make_target(root / "llama", arch="llama"),
        "qwen3": make_target(root / "qwen3", arch="qwen3", seed=1),
        # A target of another width: drafters for it do not fit the others.
        "llama-narrow": make_target(root / "llama-narrow", hidden_size=128, num_heads=2, num_kv_heads=1),
    }
    # The main drafter takes the user's path: training layout, then `edsd convert`.
    make_drafter(
        paths["llama"], root / "llama-edsd-training", draft_vocab_size=256, aux_layer_ids=(1, 3), layout=EDSD_TRAINING
    )
    convert(root / "llama-edsd-training", root / "llama-edsd", target=paths["llama"])
    constant = most_frequent_greedy_token(paths["llama"], 512 - CONSTANT_DRAFT_VOCAB)
    make_drafter(
        paths["llama"], root / "llama-edsd-constant", draft_vocab_size=CONSTANT_DRAFT_VOCAB, constant_token=constant
    )
    make_drafter(paths["qwen3"], root / "qwen3-edsd", draft_vocab_size=384, aux_layer_ids=(2, 4), seed=2)
    paths.update(
        {name: root / name for name in ("llama-edsd", "llama-edsd-training", "llama-edsd-constant", "qwen3-edsd")}
    )
    return {**{k: str(v) for k, v in paths.items()}, "constant_token": constant}


@pytest.fixture(scope="session")
def massive_activation(tmp_path_factory) -> dict:
    """A toy target whose first token carries 30,000 on one dimension (as SmolLM2-135M's carries
    about 24,800), and an EDSD drafter whose fed-back state grows about tenfold per step: their
    float32 values pass float16's 65,504 at every draft step (tests/unit/test_model_float16.py)."""
    def build(root: Path) -> dict:
        target = make_target(root / "target", seed=3, first_token_spike=30000.0)
        make_drafter(target, root / "drafter", draft_vocab_size=256, fusion_gain=5.0)
        return {"target": str(target), "drafter": str(root / "drafter")}

    return build_once(tmp_path_factory, "massive-activation", build)


@pytest.fixture(scope="session")
def fitted_target(tmp_path_factory) -> str:
    """A toy target fitted to the toy corpus: its greedy text is text-like and partly
    memorised, so regenerated answers round-trip through the tokenizer and a drafter has
    something to learn (a random-weight target has neither)."""
    return build_once(tmp_path_factory, "fitted", lambda root: str(make_target(root / "target", seed=3,
                                                                               train_steps=300)))


@pytest.fixture(scope="session")
def trained(fitted_target, tmp_path_factory) -> dict:
    """The user's path on the fitted target: ``edsd select``, ``edsd train`` (EDSD and the
    EAGLE-3 baseline, regenerated data) and ``edsd convert`` (unfolded and folded). The trained
    drafters' proposals depend on every weight and are often accepted, so serving tests that
    use them fail when a layer is mis-sharded or mis-loaded."""
    return build_once(tmp_path_factory, "pipeline", lambda root: train_on_fitted(fitted_target, root))


def train_on_fitted(target: str, root: Path) -> dict:
    from transformers import AutoTokenizer

    from vllm_edsd.cli import main
    from vllm_edsd.data import render_conversation

    lines = [l for l in toy_corpus().splitlines() if l.strip()]
    data = root / "chat.jsonl"
    data.write_text(
        "\n".join(
            json.dumps({"messages": [{"role": "user", "content": l}, {"role": "assistant", "content": "-"}]})
            for l in lines[:24]
        )
    )
    make_drafter(target, root / "untrained", draft_vocab_size=256)
    assert main(["select", target, "--data", str(data), "--samples", "8", "--out", str(root / "layers.json")]) == 0
    # one regeneration and one feature extraction (vLLM's, the default) for both methods
    selected = json.loads((root / "layers.json").read_text())["aux_layer_ids"]
    common = ["--data", str(data), "--regenerate", "--max-length", "96", "--draft-vocab-size", "256",
              "--epochs", "8", "--ttt-steps", "3", "--lr", "1e-2", "--batch-size", "4", "--cache", str(root / "cache"),
              # the regime the serving tests' acceptance was calibrated on
              "--lr-schedule", "constant", "--weight-decay", "0.01",
              "--feature-layers", ",".join(map(str, sorted({*selected, 1, 2, 3})))]
    assert (
        main(["train", target, "--out", str(root / "edsd"), "--layers-from", str(root / "layers.json"), *common]) == 0
    )
    assert (
        main(["train", target, "--out", str(root / "eagle3"), "--method", "eagle3", "--layers", "1,2,3", *common]) == 0
    )
    assert main(["convert", str(root / "edsd" / "final"), str(root / "edsd-vllm"), "--target", target]) == 0
    assert main(["convert", str(root / "edsd" / "final"), str(root / "edsd-folded"), "--target", target,
                 "--fold-token-norm"]) == 0
    tokenizer = AutoTokenizer.from_pretrained(target)
    chats = [[{"role": "user", "content": l}] for l in lines[24:]]
    prompts = [render_conversation(tokenizer, chat, generation_prompt=True)[0] for chat in chats[:8]]
    return {"target": target, "edsd": str(root / "edsd-vllm"), "edsd-folded": str(root / "edsd-folded"),
            "edsd-training": str(root / "edsd" / "final"),
            "eagle3": str(root / "eagle3" / "final"), "untrained": str(root / "untrained"),
            "prompts": prompts, "chats": chats}


@pytest.fixture(scope="module")
def drafters(models, tmp_path_factory) -> dict[str, str]:
    """Broken variants of the toy drafter, one defect each."""
    root = tmp_path_factory.mktemp("bad-drafters")
    good = models["llama-edsd"]

    def variant(name: str, edit_config=None, edit_tensors=None) -> str:
        return str(edited_copy(good, root / name, edit_config, edit_tensors))

    def three_ids(cfg):
        cfg["edsd_config"]["aux_layer_ids"] = [1, 2, 3]

    def out_of_range(cfg):
        cfg["edsd_config"]["aux_layer_ids"] = [1, 9]
        cfg["edsd_config"].pop("target")

    make_drafter(models["llama-narrow"], root / "other-target-drafter", draft_vocab_size=256)
    no_weights = variant("no-weights")
    (root / "no-weights" / "model.safetensors").unlink()
    no_config = variant("no-config")
    (root / "no-config" / "config.json").unlink()
    (root / "broken-json").mkdir()
    (root / "broken-json" / "config.json").write_text("{not json")
    make_drafter(models["llama"], root / "training-layout", draft_vocab_size=256, layout=EDSD_TRAINING)
    return {
        "three_ids": variant("three-ids", three_ids),
        "out_of_range": variant("out-of-range", out_of_range),
        "missing_tensor": variant("missing-tensor", edit_tensors=lambda t: t.pop("lm_head.weight")),
        "wrong_shape": variant(
            "wrong-shape", edit_tensors=lambda t: t.update({"fc.weight": t["fc.weight"][:, :100].clone()})
        ),
        "other_target": str(root / "other-target-drafter"),
        "no_weights": no_weights,
        "no_config": no_config,
        "broken_json": str(root / "broken-json"),
        "training_layout": str(root / "training-layout"),
        "missing_dir": str(root / "does-not-exist"),
    }


@pytest.fixture(scope="session")
def parity_drafters(models, tmp_path_factory) -> dict:
    """Drafters whose drafts depend on every weight (random, token norms too), one per token
    norm, each converted unfolded and folded: ``{(norm, folded): (served dir, source dir)}``,
    and one with Llama-3.1's RoPE scaling, ``{"llama3-rope": ...}``.
    The RMSNorm one is a SpecForge checkpoint (sharded, with its own copy of the embedding),
    the LayerNorm one this project's training layout."""
    return build_once(tmp_path_factory, "parity", lambda root: build_parity_drafters(models, root))


def build_parity_drafters(models: dict, root: Path) -> dict:
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
    llama3 = edited_copy(
        layernorm, root / "llama3-rope-training", edit_config=lambda c: c.update(rope_parameters=LLAMA3_ROPE)
    )
    convert(llama3, root / "llama3-rope", target=models["llama"])
    drafters["llama3-rope"] = (str(root / "llama3-rope"), str(llama3))
    return drafters


@pytest.fixture(scope="session")
def engine_runs(tmp_path_factory):
    """Memoised engine jobs: ``engine_runs(key, job)`` runs each key once per test run (once for
    all xdist workers)."""
    cache: dict[str, dict] = {}

    def run(key: str, job: dict, env: dict | None = None) -> dict:
        if key not in cache:
            cache[key] = build_once(tmp_path_factory, f"engine-{key}",
                                    lambda workdir: run_engine_job(job, workdir, env))
        return cache[key]

    return run


@pytest.fixture(scope="session")
def plain_outputs(trained, engine_runs) -> list[list[int]]:
    """The fitted target's greedy outputs of ``trained["prompts"]`` without speculation."""
    return serve_fitted(trained, engine_runs, "pipeline-none", None)["outputs"]


@pytest.fixture(scope="session")
def baseline(models, engine_runs):
    """Greedy outputs of each toy target without speculation: of PROMPTS (phase ``greedy``) and
    of SHARED_PREFIX_PROMPTS (``shared-prefix``)."""

    def outputs(arch: str, phase: str = "greedy") -> list[list[int]]:
        job = {
            "target": models[arch],
            "llm_kwargs": {"enforce_eager": True, "dtype": "float32"},
            "phases": [greedy_phase(), greedy_phase("shared-prefix", SHARED_PREFIX_PROMPTS, SHARED_PREFIX_TOKENS)],
        }
        return engine_runs(f"baseline-{arch}", job)["phases"][phase]["outputs"]

    return outputs


def completion_body(prompts: list[list[int]], **extra) -> dict:
    """A greedy completion request for token-id prompts whose answer carries token ids."""
    return {"model": "toy", "prompt": prompts, "max_tokens": FITTED_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_tokens_as_token_ids": True, "logprobs": 1, **extra}


def answer_token_ids(answer: dict) -> list[list[int]]:
    """The token ids of a completion answer's choices, in prompt order."""
    choices = sorted(answer["choices"], key=lambda c: c["index"])
    return [[int(t.split(":", 1)[1]) for t in c["logprobs"]["tokens"]] for c in choices]


def completion_token_ids(base: str, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy completions of token-id prompts, as token ids, in prompt order."""
    import requests

    return answer_token_ids(requests.post(f"{base}/v1/completions", json=completion_body(prompts), timeout=300).json())


def drafting_engines(metrics: str) -> set[str]:
    """The engine indices whose ``/metrics`` series count at least one draft."""
    return {line.split('engine="', 1)[1].split('"', 1)[0] for line in metrics.splitlines()
            if line.startswith("vllm:spec_decode_num_drafts_total{") and float(line.rsplit(" ", 1)[1]) > 0}


def abandon_streams(url: str, bodies: list[dict], events: int = 4, patience_s: float = 1.0) -> list[int]:
    """Stream each request body (in parallel) and walk away, as a client that loses interest
    does: after ``events`` server-sent events, or ``patience_s`` seconds without the next one
    (a reply whose tokens have no text sends none), once the first has come. Returns how many
    events each read before it closed the connection."""
    import http.client
    import threading
    from urllib.parse import urlsplit

    where = urlsplit(url)
    read: list[int] = []

    def walk_away(body: dict) -> None:
        connection, seen = http.client.HTTPConnection(where.hostname, where.port, timeout=120), 0
        try:
            connection.request("POST", where.path, json.dumps({**body, "stream": True}),
                               {"Content-Type": "application/json"})
            reply = connection.getresponse()
            while seen < events:
                line = reply.readline()
                if not line:
                    break
                if line.startswith(b"data:"):
                    seen += 1
                    connection.sock.settimeout(patience_s)  # the first event came: from now on, impatient
        except TimeoutError:
            pass
        finally:
            read.append(seen)
            connection.close()  # the server sees the client gone

    threads = [threading.Thread(target=walk_away, args=(body,)) for body in bodies]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return read


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` need CUDA (``bash scripts/test_gpu.sh`` on a GPU machine): skipped
    where torch sees no GPU."""
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if gpu:
        import torch

        if not torch.cuda.is_available():
            for item in gpu:
                item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
