"""EDSelect's metrics on matrices with known structure, the selection rule, and the command."""

from __future__ import annotations

import json
import math

import pytest
import torch

from vllm_edsd.cli import main
from vllm_edsd.selection import metrics

G = torch.Generator().manual_seed(0)


def test_matrix_entropy_counts_directions():
    d = 32
    isotropic = torch.randn(20000, d, generator=G)
    assert metrics.matrix_entropy(isotropic) == pytest.approx(math.log(d), abs=0.02)
    rank4 = torch.randn(20000, 4, generator=G) @ torch.linalg.qr(torch.randn(d, 4, generator=G)).Q.T
    assert metrics.matrix_entropy(rank4) == pytest.approx(math.log(4), abs=0.02)


def test_curvature_straight_and_random():
    line = torch.linspace(0, 1, 50)[:, None] * torch.randn(1, 16, generator=G)
    assert metrics.curvature_score([line]) == pytest.approx(math.pi, abs=1e-4)  # angle 0
    zigzag = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 0.0], [1.0, 0.0]])
    assert metrics.curvature_score([zigzag]) == pytest.approx(0.0, abs=1e-4)  # angle pi
    walk = torch.randn(4000, 256, generator=G).cumsum(0)  # independent steps: angle pi/2
    assert metrics.curvature_score([walk]) == pytest.approx(math.pi / 2, abs=0.02)


def test_lidar_is_the_effective_rank_of_class_separation():
    d, k = 16, 3
    directions = torch.linalg.qr(torch.randn(d, k, generator=G)).Q.T
    classes = []
    for _ in range(300):
        centre = torch.randn(k, generator=G) @ directions * 10
        classes.append(centre + 0.01 * torch.randn(8, d, generator=G))
    assert metrics.lidar(classes) == pytest.approx(k, rel=0.1)


def test_select_layers_rule():
    """Curvature picks the middle layer, LiDAR the high one, each from its range, whatever the
    other metric says; below 4 layers, the two maxima over every layer."""
    n = 12  # ranges: curvature 2..8, lidar 9..11
    scores = {l: {"curvature": 0.0, "lidar": 0.0} for l in range(1, n + 1)}
    scores[1]["lidar"] = scores[1]["curvature"] = 99  # the layer next to the embeddings: never chosen
    scores[12]["lidar"] = 98  # the last layer's output, not a layer input: never chosen
    scores[5]["curvature"], scores[10]["lidar"] = 1.0, 1.0
    scores[10]["curvature"], scores[5]["lidar"] = 50.0, 50.0  # each outside the other metric's range
    assert metrics.select_layers(scores, n) == (5, 10, {"curvature": 5, "lidar": 10})
    shallow = {1: {"curvature": 0.1, "lidar": 5}, 2: {"curvature": 0.9, "lidar": 7}, 3: {"curvature": 0.5, "lidar": 6}}
    assert metrics.select_layers(shallow, 3) == (2, 3, {"curvature": 2, "lidar": 3})  # same best: next by LiDAR
    shallow[1]["lidar"] = 9
    assert metrics.select_layers(shallow, 3) == (1, 2, {"curvature": 2, "lidar": 1})


def test_every_pick_of_the_paper_lies_in_its_metrics_range():
    for model, (layers, curvature, lidar) in metrics.PAPER_PICKS.items():
        ranges = metrics.role_ranges(layers)
        assert curvature in ranges["curvature"] and lidar in ranges["lidar"], model


def test_edselect_finds_the_straight_middle_layer_and_the_separable_high_layer():
    """Features built so that one middle layer has the straightest trajectories and one high
    layer the most class-separable pooled representations: EDSelect must pick exactly those."""
    n, d, classes, copies, tokens = 8, 12, 24, 4, 16  # ranges: curvature 2..5, lidar 6..7
    straight_layer, separable_layer = 4, 7
    stats = {layer: metrics.LayerStatistics(d, 256) for layer in range(1, n + 1)}
    centres = torch.randn(classes, d, generator=G)
    for c in range(classes):
        for layer, stat in stats.items():
            walk = torch.randn(1 + copies, tokens, d, generator=G).cumsum(1)  # angle about pi/2
            if layer == straight_layer:  # nearly a line: angle near 0
                walk = torch.linspace(0, 1, tokens)[None, :, None] * centres[c] + 0.01 * walk
            if layer == separable_layer:  # copies close to their class's centre
                walk = 0.05 * walk + 10 * centres[c]
            stat.add(walk, torch.arange(tokens))
    scores = {layer: stat.scores() for layer, stat in stats.items()}
    assert max(scores, key=lambda l: scores[l]["curvature"]) == straight_layer
    assert max(range(6, 8), key=lambda l: scores[l]["lidar"]) == separable_layer
    assert metrics.select_layers(scores, n) == (straight_layer, separable_layer,
                                                  {"curvature": straight_layer, "lidar": separable_layer})


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
