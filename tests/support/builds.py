"""What the model fixtures of tests/conftest.py build: the toy targets and drafters, the massive
activation pair, the broken and the parity drafters (EDSD's and EAGLE 3.1's), and the user's
pipeline trained on the fitted target."""

from __future__ import annotations

import json
from pathlib import Path

from support.drafters import edited_copy
from support.prompts import PROMPTS
from support.specforge_layout import write_specforge_checkpoint
from support.toy import make_drafter, make_eagle3_drafter, make_target, toy_corpus
from vllm_edsd.methods.draft_config import FC_INPUT_NORMS
from vllm_edsd.methods.edsd.config import LAYERNORM, RMSNORM
from vllm_edsd.methods.edsd.layouts import EDSD_TRAINING
from weights_convert import convert

CONSTANT_DRAFT_VOCAB = 64
# Llama-3.1's RoPE scaling, with a short original context so that it changes most frequencies.
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


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


# EAGLE 3.1's switches (methods/eagle3/config.py): speculators' default, and the per-layer fc norm.
EAGLE31_DRAFTERS = {
    "eagle31-norm-before-fc": {"norm_before_fc": True, "norm_before_residual": True, "norm_output": True},
    "eagle31-fc-norm": {"fc_norm": True},
}


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
    for fc_input_norm in FC_INPUT_NORMS:  # the token-reading draft layer, fc's input normed either way;
        reads_token = root / f"reads-token-{fc_input_norm}-training"  # with one norm, both residual switches
        residuals = fc_input_norm == "norm_before_fc"
        make_drafter(models["llama"], reads_token, draft_vocab_size=256, layout=EDSD_TRAINING, seed=6,
                     attention_reads_token=True, feature_norm=True, **{fc_input_norm: True},
                     norm_before_residual=residuals, fuse_residual=residuals)
        convert(reads_token, root / f"reads-token-{fc_input_norm}", target=models["llama"])
        drafters["reads-token", fc_input_norm] = (str(root / f"reads-token-{fc_input_norm}"), str(reads_token))
    for seed, (name, switches) in enumerate(EAGLE31_DRAFTERS.items(), start=7):
        make_eagle3_drafter(models["llama"], root / name, seed=seed, **switches)
        drafters[name] = (str(root / name), str(root / name))  # vLLM serves what the reference reads
    return drafters


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
              # regeneration's and the features' engines without torch.compile
              # (tests/engine/test_features_extraction.py runs the compiled default)
              "--vllm-args", json.dumps({"enforce_eager": True}),
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


def build_massive_activation(root: Path) -> dict:
    """The ``massive_activation`` fixture's target and drafters: the paper's draft layer, the
    one whose attention also reads the token and whose fc reads the features normed
    (``norm_before_fc``: normed in float32, where float16 squares the spike past its range), and
    that one with both residual switches (``norm_before_residual``, and ``fuse_residual``: EDFuse
    adds the raw fed-back state, float32 in float16's stream, to its output)."""
    target = make_target(root / "target", seed=3, first_token_spike=30000.0)
    make_drafter(target, root / "drafter", draft_vocab_size=256, fusion_gain=5.0)
    reads_token = {"draft_vocab_size": 256, "fusion_gain": 5.0, "attention_reads_token": True, "norm_before_fc": True}
    make_drafter(target, root / "reads-token", **reads_token)
    make_drafter(target, root / "normed-residual", **reads_token, norm_before_residual=True, fuse_residual=True)
    return {"target": str(target), **{name: str(root / name) for name in ("drafter", "reads-token", "normed-residual")}}


def build_broken_drafters(models: dict, root: Path) -> dict[str, str]:
    """The ``drafters`` fixture: variants of the toy drafter, one defect each."""
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
