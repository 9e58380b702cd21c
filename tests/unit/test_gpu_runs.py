"""The learning curve's work carried to and from a GPU machine (``bench.gpu_runs``): prompts cut
on the regeneration cache's chunk boundaries, and runs packed in parts and unpacked whole."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from bench import gpu_runs
from vllm_edsd.errors import EDSDError


def test_slices_are_whole_chunks_in_order():
    items = list(range(1000))
    parts = gpu_runs.whole_chunks(items, 3, 256)
    assert [len(p) for p in parts] == [512, 488]  # 4 chunks in 3 slices: two of 2 chunks, not 3 ragged
    assert sum(parts, []) == items
    assert [len(p) for p in gpu_runs.whole_chunks(items[:40], 8, 256)] == [40]
    assert [len(p) for p in gpu_runs.whole_chunks(items, 8, 100)] == [200] * 5


def run_dir(work, name, checkpoint, weight):
    run = work / "curve" / "regenerated-data" / name
    (run / checkpoint).mkdir(parents=True)
    (run / checkpoint / "config.json").write_text(json.dumps({"architectures": ["X"]}))
    save_file({"w": weight, "ids": torch.arange(5)}, run / checkpoint / "model.safetensors")
    (run / "train_log.jsonl").write_text(json.dumps({"epoch": 0, "loss": 1.0}) + "\n")
    (run / "training_state.pt").write_bytes(b"optimizer state: stays behind")
    return run


def test_pack_unpack_round_trip(tmp_path, monkeypatch):
    work, packed, back = tmp_path / "work", tmp_path / "packed", tmp_path / "back"
    work.mkdir()
    (work / "regenerated-data.jsonl").write_text('{"messages": []}\n')
    (work / "layers.json").write_text('{"layers": [20, 29]}')
    weight = torch.randn(64, 64) * 3
    run_dir(work, "edsd-10", "final", weight)
    unfinished = run_dir(work, "eagle3-10", "epoch_0", weight)
    (unfinished / "epoch_1").mkdir()  # a checkpoint cut short: no weights, not taken
    (unfinished / "epoch_1" / "config.json").write_text("{}")
    monkeypatch.setattr(gpu_runs, "PART_BYTES", 4096)
    parts = gpu_runs.pack(work, packed)
    assert len(parts) > 1 and all(p.stat().st_size <= 4096 for p in parts)

    manifest = gpu_runs.unpack(packed, back)
    assert manifest["runs"] == {"curve/regenerated-data/edsd-10": "final",
                                "curve/regenerated-data/eagle3-10": "epoch_0"}
    assert (back / "regenerated-data.jsonl").read_text() == '{"messages": []}\n'
    assert (back / "layers.json").is_file()
    for name, checkpoint in manifest["runs"].items():
        tensors = load_file(back / name / checkpoint / "model.safetensors")
        assert tensors["w"].dtype == torch.float32 and torch.equal(tensors["w"], weight.half().float())
        assert torch.equal(tensors["ids"], torch.arange(5))
        assert (back / name / "train_log.jsonl").is_file()
        assert json.loads((back / name / "carried.json").read_text()) == {"weights_rounded_to": "float16"}
        assert not (back / name / "training_state.pt").exists()


def test_unpack_refuses_a_missing_part(tmp_path, monkeypatch):
    work = tmp_path / "work"
    run_dir(work, "edsd-10", "final", torch.randn(256, 256))
    monkeypatch.setattr(gpu_runs, "PART_BYTES", 4096)
    parts = gpu_runs.pack(work, tmp_path / "packed")
    parts[1].unlink()
    with pytest.raises(EDSDError, match="do not join"):
        gpu_runs.unpack(tmp_path / "packed", tmp_path / "back")
    with pytest.raises(EDSDError, match="no learning-curve.tar.xz"):
        gpu_runs.unpack(tmp_path / "empty", tmp_path / "back")


def test_seed_puts_kept_data_where_missing(tmp_path):
    """The answers kept compressed in the repository and EDSelect's layers go into a work
    directory; what is there already is left alone."""
    import lzma

    kept, work = tmp_path / "kept", tmp_path / "work"
    kept.mkdir()
    (kept / "regenerated-data.jsonl.xz").write_bytes(lzma.compress(b'{"messages": []}\n'))
    (kept / "layers.json").write_text('{"aux_layer_ids": [20, 29]}')
    assert {p.name for p in gpu_runs.seed(kept, work)} == {"regenerated-data.jsonl", "layers.json"}
    assert (work / "regenerated-data.jsonl").read_text() == '{"messages": []}\n'
    (work / "layers.json").write_text("mine")
    assert gpu_runs.seed(kept, work) == [] and (work / "layers.json").read_text() == "mine"
    with pytest.raises(EDSDError, match="no such folder"):
        gpu_runs.seed(tmp_path / "nowhere", work)


def test_seed_defaults_to_the_kept_10k_run(tmp_path):
    """Without a folder, ``seed`` puts the repository's kept 10k answers and layers into the work
    directory: the names the draft-layer-10k curve looks for."""
    work, answers = tmp_path / "work", "regenerated-8070chat-1973code-192tokens-seed0.jsonl"
    assert gpu_runs.main(["seed", "--work", str(work)]) == 0
    assert sorted(p.name for p in work.iterdir()) == ["layers.json", answers]
    assert sum(1 for _ in (work / answers).open()) == 10043
