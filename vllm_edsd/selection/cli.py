"""``edsd select``: run EDSelect on a calibration set and write the scores and the choice."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from vllm_edsd.checkpoint.files import replace_file
from vllm_edsd.checkpoint.target import LAYER_INPUT, sequence_length
from vllm_edsd.data import load_conversations, load_sharegpt, render_many
from vllm_edsd.errors import EDSDError
from vllm_edsd.features.hidden_states import decoder_of, fingerprint
from vllm_edsd.launch.transformers_target import load_target

from . import metrics
from .scoring import score_layers

DEFAULT_MAX_LENGTH = 512

EPILOG = """\
examples:
  edsd select /models/Llama-3.1-8B-Instruct --out layers.json --plot layers.png
  edsd select TARGET --data calib.jsonl --samples 64 --max-length 256 --out layers.json
--data takes ShareGPT-style JSON ([{"conversations": [{"from": "human", "value": ...}, ...]}])
or JSON lines with "conversations", "messages" or "text". Default: ShareGPT from PyPI.
"""


# The `edsd select` subcommand (vllm_edsd.command).
name = "select"
help = "EDSelect: score every target layer and pick the two aux layers"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    parser.add_argument("target", help="target model directory (transformers format)")
    parser.add_argument("--out", required=True, help="JSON file for the per-layer scores and the chosen ids")
    parser.add_argument("--data", help="calibration conversations (default: ShareGPT)")
    parser.add_argument("--samples", type=int, default=128, help="calibration samples (default 128, the paper's)")
    parser.add_argument("--max-length", type=int, default=None,
                        help=f"tokens per sample (default {DEFAULT_MAX_LENGTH}, or the target's context where it "
                             "holds fewer)")
    parser.add_argument("--plot", help="PNG of the per-layer profiles (like the paper's Fig. 4)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")


def plot(scores: dict[int, dict[str, float]], chosen: dict[str, int], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = sorted(scores)
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.5))
    for ax, metric in zip(axes, ("curvature", "lidar", "matrix_entropy")):
        ax.plot(layers, [scores[l][metric] for l in layers], marker="o", ms=3)
        if metric in chosen:
            ax.axvline(chosen[metric], color="red", ls="--", label=f"chosen: {chosen[metric]}")
            ax.legend()
        ax.set_xlabel("layer id (input of layer, vLLM convention)")
        ax.set_title(metric.replace("_", " "))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    if args.samples < 2:
        raise EDSDError("--samples must be at least 2 (LiDAR needs several classes)")
    args.max_length = sequence_length(args.target, args.max_length, DEFAULT_MAX_LENGTH, "--max-length")
    model = load_target(args.target, device=args.device)
    tokenizer = AutoTokenizer.from_pretrained(args.target, local_files_only=True)
    conversations = load_conversations(args.data) if args.data else load_sharegpt(args.samples * 2, args.seed)
    sequences = [ids for ids, _ in render_many(tokenizer, conversations, args.max_length)[0] if len(ids) >= 4]
    sequences = sequences[: args.samples]
    if len(sequences) < 2:
        raise EDSDError(f"only {len(sequences)} calibration samples of at least 4 tokens; need 2 or more")
    scores = score_layers(model, sequences, args.seed, args.device)
    num_layers = len(decoder_of(model).layers)
    a, b, chosen = metrics.select_layers(scores, num_layers)
    ranges = metrics.role_ranges(num_layers)
    result = {
        "target": Path(args.target).resolve().name,  # descriptive: no directory of this machine
        "fingerprint": vars(fingerprint(model)),
        "samples": len(sequences),
        "max_length": args.max_length,
        "metrics": metrics.__doc__,
        "scores": {str(l): s for l, s in scores.items()},
        "aux_layer_ids": [a, b],
        "aux_layer_id_convention": LAYER_INPUT,
        "chosen_by": chosen,
        "chosen_from": {metric: [r.start, r.stop - 1] for metric, r in ranges.items()} if ranges else "every layer",
    }
    replace_file(args.out, lambda tmp: tmp.write_text(json.dumps(result, indent=2) + "\n"))
    if args.plot:
        plot(scores, chosen, args.plot)
    print(f"{'layer':>5} {'curvature':>10} {'lidar':>8} {'entropy':>8}")
    for layer, s in scores.items():
        mark = " <- " + ", ".join(m for m, l in chosen.items() if l == layer) if layer in chosen.values() else ""
        print(f"{layer:>5} {s['curvature']:>10.4f} {s['lidar']:>8.2f} {s['matrix_entropy']:>8.3f}{mark}")
    print(f"aux layers (vLLM convention): {[a, b]}  -> {args.out}")
    return 0
