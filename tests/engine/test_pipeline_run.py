"""The user's whole path on a tiny target: select → train (regenerated data) → convert →
serve, for EDSD and the EAGLE-3 baseline trained the same way; trained beats untrained,
output stays lossless, and the acceptance predicted offline equals vLLM's counters."""

from __future__ import annotations

from support.drafters import edsd_spec
from support.engine_checks import assert_counters_match, predicted_counters
from support.engine_runs import serve_fitted
from support.toy import toy_corpus

K = 3
EAGER = {"enforce_eager": True}  # the regeneration engines without torch.compile


def explicit_edsd(trained: dict, engine_runs) -> dict:
    """The trained EDSD drafter requested explicitly, ``"method": "edsd"``, on the fitted target."""
    return serve_fitted(trained, engine_runs, "pipeline-edsd",
                        edsd_spec(trained["edsd"], K))


def test_trained_drafters_serve_losslessly_and_beat_untrained(models, engine_runs, trained):
    plain = serve_fitted(trained, engine_runs, "pipeline-none", None)
    runs = {
        name: serve_fitted(
            trained, engine_runs, f"pipeline-{name}", {"method": method, "model": path, "num_speculative_tokens": K}
        )
        for name, method, path in [
            ("edsd", "edsd", trained["edsd"]),
            ("eagle3", "eagle3", trained["eagle3"]),
            ("untrained", "edsd", trained["untrained"]),
        ]
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
    run = explicit_edsd(trained, engine_runs)
    assert_counters_match(predicted_counters(trained, run["outputs"], K), run["counters"])


def test_drafter_directory_served_alone_is_the_explicit_request(engine_runs, trained, tmp_path_factory):
    """``LLM(model=DRAFTER_DIR)``, no speculative config: vLLM reads the target and
    ``"method": "edsd"`` from the drafter's speculators block (docs/formats.md) and serves what
    the explicit request serves, token for token and draft for draft."""
    from vllm_edsd.cli import main

    alone = tmp_path_factory.mktemp("served-alone") / "edsd"
    assert main(["convert", trained["edsd-training"], str(alone), "--target", trained["target"],
                 "--num-speculative-tokens", str(K)]) == 0
    explicit = explicit_edsd(trained, engine_runs)
    run = serve_fitted(trained, engine_runs, "pipeline-edsd-alone", None, model=str(alone))
    assert run["outputs"] == explicit["outputs"]
    assert run["counters"] == explicit["counters"] and run["counters"]["drafts"] > 0
    assert run["counters"]["draft_tokens"] == K * run["counters"]["drafts"]


def test_regeneration_cache_is_keyed_by_its_inputs(trained, tmp_path, monkeypatch):
    """The same conversations reuse the cache; more of them (a larger --max-samples, or a run
    interrupted after its first chunk) regenerate only the chunks not yet written; other
    conversations never reuse stale answers."""
    from vllm_edsd.regeneration import answers

    monkeypatch.setattr(answers, "REGENERATE_CHUNK", 2)
    lines = [l for l in toy_corpus().splitlines() if l.strip()][32:37]
    convs = [[{"role": "user", "content": l}] for l in lines]
    first = answers.regenerate(trained["target"], convs[:2], tmp_path, 8, EAGER)
    assert [c[0]["content"] for c in first] == lines[:2]
    (chunk,) = tmp_path.glob("regenerated-*.jsonl")
    written = chunk.stat().st_mtime_ns
    assert answers.regenerate(trained["target"], convs[:2], tmp_path, 8, EAGER) == first
    every = answers.regenerate(trained["target"], convs, tmp_path, 8, EAGER)
    assert every[:2] == first and [c[0]["content"] for c in every] == lines
    assert chunk.stat().st_mtime_ns == written and len(list(tmp_path.glob("regenerated-*.jsonl"))) == 3
