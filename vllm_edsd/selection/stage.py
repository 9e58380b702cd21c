"""``edsd select`` as a call: ``SelectOptions`` (the command's flags, with its defaults) and
``run``, which the command and the pipeline both call: EDSelect on a calibration set, the
scores and the choice written as JSON."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from vllm_edsd.checkpoint.files import file_hash, replace_file
from vllm_edsd.checkpoint.target import LAYER_INPUT, sequence_length
from vllm_edsd.command import POSITIONAL
from vllm_edsd.data import load_conversations, load_sharegpt, render_many
from vllm_edsd.errors import EDSDError
from vllm_edsd.features.hidden_states import decoder_of, fingerprint
from vllm_edsd.launch.transformers_target import default_device, load_target

from . import metrics
from .scoring import score_layers

DEFAULT_MAX_LENGTH = 512


@dataclass(frozen=True, kw_only=True)
class SelectOptions:
    """The target, its calibration conversations and where the choice goes."""

    target: str = field(metadata={POSITIONAL: True})  # a transformers directory
    out: str  # JSON of the per-layer scores and the chosen ids
    data: str | None = None  # calibration conversations; None: ShareGPT
    samples: int = 128  # calibration samples (the paper's 128)
    max_length: int | None = None  # tokens per sample; None: DEFAULT_MAX_LENGTH, or the target's context
    plot: str | None = None  # PNG of the per-layer profiles
    seed: int = 0
    device: str | None = None  # None: cuda if present, else cpu


def run(options: SelectOptions) -> dict:
    """EDSelect's record, also written to ``options.out``: every layer's scores and the two aux
    layers (``aux_layer_ids``, vLLM's convention)."""
    from transformers import AutoTokenizer

    if options.samples < 2:
        raise EDSDError("--samples must be at least 2 (LiDAR needs several classes)")
    max_length = sequence_length(options.target, options.max_length, DEFAULT_MAX_LENGTH, "--max-length")
    device = default_device(options.device)
    model = load_target(options.target, device=device)
    tokenizer = AutoTokenizer.from_pretrained(options.target, local_files_only=True)
    conversations = (load_conversations(options.data) if options.data
                     else load_sharegpt(options.samples * 2, options.seed))
    sequences = [ids for ids, _ in render_many(tokenizer, conversations, max_length)[0] if len(ids) >= 4]
    sequences = sequences[: options.samples]
    if len(sequences) < 2:
        raise EDSDError(f"only {len(sequences)} calibration samples of at least 4 tokens; need 2 or more")
    scores = score_layers(model, sequences, options.seed, device)
    num_layers = len(decoder_of(model).layers)
    a, b, chosen = metrics.select_layers(scores, num_layers)
    ranges = metrics.role_ranges(num_layers)
    result = {
        "target": Path(options.target).resolve().name,  # descriptive: no directory of this machine
        "fingerprint": vars(fingerprint(model)),
        "samples": len(sequences),
        "max_length": max_length,
        "calibration": calibration(options),
        "metrics": metrics.__doc__,
        "scores": {str(l): s for l, s in scores.items()},
        "aux_layer_ids": [a, b],
        "aux_layer_id_convention": LAYER_INPUT,
        "chosen_by": chosen,
        "chosen_from": {metric: [r.start, r.stop - 1] for metric, r in ranges.items()} if ranges else "every layer",
    }
    replace_file(options.out, lambda tmp: tmp.write_text(json.dumps(result, indent=2) + "\n"))
    if options.plot:
        plot(scores, chosen, options.plot)
    print_scores(scores, chosen)
    print(f"aux layers (vLLM convention): {[a, b]}  -> {options.out}")
    return result


def calibration(options: SelectOptions) -> dict:
    """What EDSelect ran on, as its JSON records it: the calibration file's name and digest (or
    ShareGPT), the samples asked for, the length given and the seed (of ShareGPT's sample and of
    LiDAR's perturbations). A choice recorded with other calibration is stale (``chosen_with``)."""
    data = Path(options.data) if options.data else None
    source = {"data": data.name, "sha256": file_hash(data).hexdigest()} if data else {"data": "sharegpt"}
    return {**source, "samples": options.samples, "max_length": options.max_length, "seed": options.seed}


def chosen_with(path: Path, options: SelectOptions) -> bool:
    """Whether ``path`` holds EDSelect's choice on ``options``' calibration (a file written by
    another run, on other data or before the record existed, is not)."""
    try:
        return json.loads(path.read_text()).get("calibration") == calibration(options)
    except (OSError, ValueError, AttributeError):  # no file, no data yet, not a JSON object
        return False


def print_scores(scores: dict[int, dict[str, float]], chosen: dict[str, int]) -> None:
    """The per-layer table, each chosen layer marked with the metric that chose it."""
    print(f"{'layer':>5} {'curvature':>10} {'lidar':>8} {'entropy':>8}")
    for layer, s in scores.items():
        mark = " <- " + ", ".join(m for m, l in chosen.items() if l == layer) if layer in chosen.values() else ""
        print(f"{layer:>5} {s['curvature']:>10.4f} {s['lidar']:>8.2f} {s['matrix_entropy']:>8.3f}{mark}")


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
