"""EDSelect's metrics on matrices with known structure, the selection rule, and the command."""

from __future__ import annotations

import json
import math

import pytest
import torch

from vllm_edsd.cli import main
from vllm_edsd.target import selection

G = torch.Generator().manual_seed(0)


def test_matrix_entropy_counts_directions():
    d = 32
    isotropic = torch.randn(20000, d, generator=G)
    assert selection.matrix_entropy(isotropic) == pytest.approx(math.log(d), abs=0.02)
    rank4 = torch.randn(20000, 4, generator=G) @ torch.linalg.qr(torch.randn(d, 4, generator=G)).Q.T
    assert selection.matrix_entropy(rank4) == pytest.approx(math.log(4), abs=0.02)


def test_curvature_straight_and_random():
    line = torch.linspace(0, 1, 50)[:, None] * torch.randn(1, 16, generator=G)
    assert selection.curvature_score([line]) == pytest.approx(math.pi, abs=1e-4)  # angle 0
    zigzag = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 0.0], [1.0, 0.0]])
    assert selection.curvature_score([zigzag]) == pytest.approx(0.0, abs=1e-4)  # angle pi
    walk = torch.randn(4000, 256, generator=G).cumsum(0)  # independent steps: angle pi/2
    assert selection.curvature_score([walk]) == pytest.approx(math.pi / 2, abs=0.02)


def test_lidar_is_the_effective_rank_of_class_separation():
    d, k = 16, 3
    directions = torch.linalg.qr(torch.randn(d, k, generator=G)).Q.T
    classes = []
    for _ in range(300):
        centre = torch.randn(k, generator=G) @ directions * 10
        classes.append(centre + 0.01 * torch.randn(8, d, generator=G))
    assert selection.lidar(classes) == pytest.approx(k, rel=0.1)


def test_select_layers_rule():
    scores = {1: {"curvature": 0.1, "lidar": 5}, 2: {"curvature": 0.9, "lidar": 7}, 3: {"curvature": 0.5, "lidar": 6}}
    assert selection.select_layers(scores) == (2, 3, {"curvature": 2, "lidar": 3})  # same best: next by LiDAR
    scores[1]["lidar"] = 9
    assert selection.select_layers(scores) == (1, 2, {"curvature": 2, "lidar": 1})


def test_select_command(models, tmp_path, capsys):
    data = tmp_path / "calib.jsonl"
    data.write_text("\n".join(json.dumps({"text": f"Sample number {i}: the quick brown fox jumps over the lazy dog."})
                              for i in range(6)))
    out, png = tmp_path / "layers.json", tmp_path / "layers.png"
    assert main(["select", models["llama"], "--data", str(data), "--samples", "6", "--out", str(out),
                 "--plot", str(png)]) == 0
    result = json.loads(out.read_text())
    assert sorted(result["scores"]) == ["1", "2", "3", "4"]
    a, b = result["aux_layer_ids"]
    assert 1 <= a < b <= 4 and result["aux_layer_id_convention"] == "layer_input"
    assert {result["chosen_by"]["curvature"], result["chosen_by"]["lidar"]} == {a, b}
    assert png.stat().st_size > 1000
    assert "aux layers (vLLM convention)" in capsys.readouterr().out
    assert main(["select", models["llama"], "--data", str(tmp_path / "missing.json"), "--out", str(out)]) == 2


PEAK_MEMORY_SCRIPT = """
import resource, sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
from vllm_edsd.target.select_cli import score_layers

samples, layers, budget = (int(a) for a in sys.argv[1:4])
torch.manual_seed(0)
config = LlamaConfig(hidden_size=2048, intermediate_size=512, num_hidden_layers=layers, num_attention_heads=16,
                     num_key_value_heads=4, vocab_size=256, max_position_embeddings=256)
model = LlamaForCausalLM(config).eval()
sequences = [torch.randint(0, 256, (48,)).tolist() for _ in range(samples)]
score_layers(model, sequences[:2], 0, "cpu", budget)  # warm-up: allocator and kernels
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
scores = score_layers(model, sequences, 0, "cpu", budget)
assert sorted(scores) == list(range(1, layers + 1))
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


def _peak_growth_mib(samples: int, layers: int, budget: int) -> int:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", PEAK_MEMORY_SCRIPT, str(samples), str(layers), str(budget)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout.split()[-1])


def test_select_memory_does_not_grow_with_samples_or_layers():
    """At a realistic width (hidden 2048) EDSelect streams: one layer's statistics are two
    D×D float64 matrices (64 MiB here), and the peak does not grow with the calibration set
    (each sequence's states and per-class covariances once stayed alive) nor, with one layer
    per pass, with the number of layers."""
    one_layer = 2 * 2048 * 2048 * 8 + 4096 * 2048 * 4
    few, many = _peak_growth_mib(4, 2, one_layer), _peak_growth_mib(24, 2, one_layer)
    deeper = _peak_growth_mib(24, 6, one_layer)
    assert many - few < 48, (few, many)
    assert deeper - many < 48, (many, deeper)
