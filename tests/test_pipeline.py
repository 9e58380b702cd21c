"""The user's whole path on a tiny target: select → train (regenerated data) → convert →
serve, for EDSD and the EAGLE-3 baseline trained the same way; trained beats untrained,
output stays lossless, and the acceptance predicted offline equals vLLM's counters."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from conftest import greedy_phase
from vllm_edsd.acceptance import predict
from vllm_edsd.cli import main
from vllm_edsd.data import render_conversation
from vllm_edsd.reference import EDSDDraftModel
from vllm_edsd.target import load_target
from vllm_edsd.toy import make_drafter, make_target, toy_corpus

K = 3


@pytest.fixture(scope="module")
def fitted_target(tmp_path_factory) -> str:
    """A toy target fitted to the toy corpus: its greedy text is text-like and partly
    memorised, so regenerated answers round-trip through the tokenizer and a drafter has
    something to learn (a random-weight target has neither)."""
    return str(make_target(tmp_path_factory.mktemp("fitted") / "target", seed=3, train_steps=300))


@pytest.fixture(scope="module")
def trained(fitted_target, tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    lines = [l for l in toy_corpus().splitlines() if l.strip()]
    data = root / "chat.jsonl"
    data.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": l}, {"role": "assistant", "content": "-"}]})
                              for l in lines[:24]))
    target = fitted_target
    make_drafter(target, root / "untrained", draft_vocab_size=256)
    assert main(["select", target, "--data", str(data), "--samples", "8", "--out", str(root / "layers.json")]) == 0
    common = ["--data", str(data), "--regenerate", "--max-length", "96", "--draft-vocab-size", "256",
              "--epochs", "8", "--ttt-steps", "3", "--lr", "1e-2", "--batch-size", "4"]
    assert main(["train", target, "--out", str(root / "edsd"), "--layers-from", str(root / "layers.json"), *common]) == 0
    assert main(["train", target, "--out", str(root / "eagle3"), "--method", "eagle3", "--layers", "1,2,3", *common]) == 0
    assert main(["convert", str(root / "edsd" / "final"), str(root / "edsd-vllm"), "--target", target]) == 0
    tokenizer = AutoTokenizer.from_pretrained(target)
    prompts = [render_conversation(tokenizer, [{"role": "user", "content": l}], generation_prompt=True)[0]
               for l in lines[24:32]]
    return {"target": target, "edsd": str(root / "edsd-vllm"), "eagle3": str(root / "eagle3" / "final"),
            "untrained": str(root / "untrained"), "prompts": prompts}


def serve(trained, engine_runs, key: str, spec: dict | None, prompts) -> dict:
    job = {"target": trained["target"], "speculative_config": spec,
           "llm_kwargs": {"enforce_eager": True, "dtype": "float32"},
           "phases": [greedy_phase(prompts=prompts, max_tokens=40)]}
    return engine_runs(key, job)["phases"]["greedy"]


def test_trained_drafters_serve_losslessly_and_beat_untrained(models, engine_runs, trained):
    prompts = trained["prompts"]
    plain = serve(trained, engine_runs, "pipeline-none", None, prompts)
    runs = {
        name: serve(trained, engine_runs, f"pipeline-{name}", {"method": method, "model": path, "num_speculative_tokens": K}, prompts)
        for name, method, path in [("edsd", "edsd", trained["edsd"]), ("eagle3", "eagle3", trained["eagle3"]),
                                   ("untrained", "edsd", trained["untrained"])]
    }
    for name, run in runs.items():
        assert run["outputs"] == plain["outputs"], name
    tau = {name: run["counters"]["tau"] for name, run in runs.items()}
    print("tau:", tau)
    assert tau["edsd"] > tau["untrained"] + 0.05
    assert tau["eagle3"] > tau["untrained"] + 0.05


def test_offline_prediction_matches_vllm(models, engine_runs, trained):
    """The reference model replaying the greedy loop predicts vLLM's counters. Tolerance:
    2% of the drafts per position, for argmax near-ties that float32 rounding can flip
    between the reference and vLLM's kernels (the parity test shows chains agree exactly)."""
    run = serve(trained, engine_runs, "pipeline-edsd",
                {"method": "edsd", "model": trained["edsd"], "num_speculative_tokens": K}, trained["prompts"])
    target = load_target(trained["target"])
    drafter = EDSDDraftModel.from_pretrained(trained["edsd"], embed_tokens=target.model.embed_tokens.weight)
    predicted = predict(drafter, target, list(zip(trained["prompts"], run["outputs"])), K)
    measured = run["counters"]
    assert predicted.drafts == pytest.approx(measured["drafts"], rel=0.02)
    for p, m in zip(predicted.accepted_per_pos, measured["accepted_per_pos"]):
        assert abs(p - m) <= 0.02 * measured["drafts"] + 1
    assert sum(measured["accepted_per_pos"]) > 0


def test_regeneration_cache_is_keyed_by_its_inputs(trained, tmp_path):
    """Other conversations (a changed --data or --max-samples) regenerate; the same ones
    reuse the cache."""
    from vllm_edsd.training.cli import regenerate

    lines = [l for l in toy_corpus().splitlines() if l.strip()][32:36]
    convs = [[{"role": "user", "content": l}] for l in lines]
    first = regenerate(trained["target"], convs[:2], tmp_path, 8)
    assert [c[0]["content"] for c in first] == lines[:2]
    assert regenerate(trained["target"], convs[:2], tmp_path, 8) == first
    other = regenerate(trained["target"], convs[2:], tmp_path, 8)
    assert [c[0]["content"] for c in other] == lines[2:]
    assert len(list(tmp_path.glob("regenerated-*.jsonl"))) == 2
