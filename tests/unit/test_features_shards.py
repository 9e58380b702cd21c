"""The feature cache on disk (``features/shards.py``, docs/scale.md "Feature shards"): each
shard one safetensors file whose header says what it was computed from, a manifest per run,
shards that disagree with the run refused in one line, and memory bounded by one shard."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from support.toy import toy_corpus

from vllm_edsd.checkpoint.files import checkpoint_fingerprint
from vllm_edsd.cli import main
from vllm_edsd.features import shards as shard_files
from vllm_edsd.features.hidden_states import TransformersFeatures
from vllm_edsd.features.shards import FeatureSpec, aux_columns, extract_features, iterate_batches, manifest_path
from vllm_edsd.launch.transformers_target import load_target

HIDDEN = 256  # the toy Llama's hidden size


@pytest.fixture(scope="module")
def conversations(tmp_path_factory) -> Path:
    lines = toy_corpus().splitlines()
    path = tmp_path_factory.mktemp("conversations") / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": question},
                                                     {"role": "assistant", "content": answer}]}) + "\n"
                            for question, answer in zip(lines[:8], lines[1:9])))
    return path


def toy_samples(count: int) -> list[tuple[list[int], list[int]]]:
    """``count`` samples of different lengths (token ids of the toy vocabulary)."""
    return [([1, *range(20 + 3 * i, 24 + 5 * i)], [0, 0, *[1] * (3 + 2 * i)]) for i in range(count)]


def test_shards_read_back_the_features_computed(models, monkeypatch, tmp_path):
    """Every sample read through ``iterate_batches`` holds exactly what ``TransformersFeatures``
    computes for it, stored for the union of two methods' layers and picked by ``columns``."""
    monkeypatch.setattr(shard_files, "SHARD_SIZE", 3)
    model, samples = load_target(models["llama"]), toy_samples(7)
    spec = FeatureSpec.of(models["llama"], (1, 2, 3), "float32", "transformers")
    shards = extract_features(TransformersFeatures(model, (1, 2, 3), batch_size=1), samples, tmp_path, spec)
    assert len(shards) == 3 and all(path.suffix == ".safetensors" for path in shards)
    direct = TransformersFeatures(model, (1, 3), batch_size=1).features([ids for ids, _ in samples])
    expected = {tuple(ids): (mask, f) for (ids, mask), f in zip(samples, direct)}
    columns = aux_columns((1, 2, 3), (1, 3), HIDDEN)
    seen = []
    for batch in iterate_batches(shards, 1, torch.Generator().manual_seed(0), columns):
        ids = tuple(batch["input_ids"][0].tolist())
        mask, f = expected[ids]
        seen.append(ids)
        assert batch["loss_mask"][0].tolist() == [bool(m) for m in mask]
        assert torch.equal(batch["aux"][0], f.aux.to(torch.bfloat16))
        assert torch.equal(batch["final"][0], f.final.to(torch.bfloat16))
        assert torch.equal(batch["target_argmax"][0], f.argmax.long())
        assert torch.equal(batch["target_entropy"][0], f.entropy.float())
    assert sorted(seen) == sorted(expected)


def test_the_manifest_lists_every_shard_and_the_targets_fingerprint(models, monkeypatch, tmp_path):
    """The manifest gives each shard's file, samples and positions and what the features were
    computed from; a prefix of the samples (a learning curve) gets its own manifest. The
    fingerprint survives a copy of the target and changes with its weights, and features of
    the changed target are extracted anew, not taken from the old one's shards."""
    monkeypatch.setattr(shard_files, "SHARD_SIZE", 2)
    samples, cache = toy_samples(5), tmp_path / "cache"
    source = TransformersFeatures(load_target(models["llama"]), (1, 3))
    spec = FeatureSpec.of(models["llama"], (1, 3), "float32", "transformers")
    shards = extract_features(source, samples, cache, spec)
    manifest = json.loads(manifest_path(cache, shards).read_text())
    assert {key: manifest[key] for key in ("format", "layers", "dtype", "backend", "target_fingerprint")} == {
        "format": shard_files.CACHE_FORMAT, "layers": [1, 3], "dtype": "float32", "backend": "transformers",
        "target_fingerprint": checkpoint_fingerprint(models["llama"])}
    chunks = (samples[0:2], samples[2:4], samples[4:])
    assert manifest["shards"] == [{"file": path.name, "samples": len(chunk),
                                   "positions": sum(len(ids) for ids, _ in chunk)}
                                  for path, chunk in zip(shards, chunks)]
    assert manifest["samples"] == 5 and manifest["positions"] == sum(len(ids) for ids, _ in samples)
    prefix = extract_features(source, samples[:4], cache, spec)
    assert prefix == shards[:2] and manifest_path(cache, prefix) != manifest_path(cache, shards)
    assert manifest_path(cache, shards).is_file() and manifest_path(cache, prefix).is_file()

    copy = Path(shutil.copytree(models["llama"], tmp_path / "copy"))
    assert checkpoint_fingerprint(copy) == checkpoint_fingerprint(models["llama"])
    weights = load_file(copy / "model.safetensors")
    save_file({name: tensor + 1e-3 for name, tensor in weights.items()}, copy / "model.safetensors")  # "fine-tuned"
    assert checkpoint_fingerprint(copy) != checkpoint_fingerprint(models["llama"])
    assert FeatureSpec.of(copy, (1, 3), "float32", "transformers").fingerprint == checkpoint_fingerprint(copy)
    moved = replace(spec, fingerprint=checkpoint_fingerprint(copy))  # the same path, new weights
    assert not set(shard_files.shard_paths(cache, moved, samples)) & set(shards)


def edsd(command: str, target: str, cache: Path, data: Path, layers: str, *extra: str) -> int:
    return main([command, target, "--cache", str(cache), "--data", str(data), "--feature-layers", layers,
                 "--features-backend", "transformers", "--device", "cpu", *extra])


def one_line_error(capsys, command: str) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"edsd {command}: error: ") and err.count("error:") == 1
    return last


def test_a_truncated_shard_or_one_of_other_layers_is_one_line(models, conversations, tmp_path, capsys):
    """``edsd features`` prints its manifest; a shard cut short, or one computed for other
    layers under this run's name, stops ``edsd features`` and ``edsd train`` with one line
    naming the file (exit 2), before any training."""
    cache, wide = tmp_path / "cache", tmp_path / "wide"
    assert edsd("features", models["llama"], cache, conversations, "1,3") == 0
    out = capsys.readouterr().out
    shard = next((cache / "features").glob("shard-*.safetensors"))
    assert f"manifest: {cache / 'features'}/manifest-" in out
    assert json.loads(Path(out.split("manifest: ")[1].strip()).read_text())["shards"][0]["file"] == shard.name
    whole = shard.read_bytes()

    shard.write_bytes(whole[: len(whole) // 2])
    assert edsd("features", models["llama"], cache, conversations, "1,3") == 2
    line = one_line_error(capsys, "features")
    assert str(shard) in line and "truncated or corrupt" in line and "delete the file" in line
    train = ("--out", str(tmp_path / "run"), "--layers", "1,3", "--draft-vocab-size", "256", "--epochs", "1")
    assert edsd("train", models["llama"], cache, conversations, "1,3", *train) == 2
    assert str(shard) in one_line_error(capsys, "train")

    assert edsd("features", models["llama"], wide, conversations, "1,2,3") == 0
    capsys.readouterr()
    shutil.copy(next((wide / "features").glob("shard-*.safetensors")), shard)
    assert edsd("train", models["llama"], cache, conversations, "1,3", *train) == 2
    line = one_line_error(capsys, "train")
    assert str(shard) in line and "layers is [1, 2, 3] in the file, [1, 3] for this run" in line
    assert not (tmp_path / "run" / "final").exists()


# The peak resident memory of the reading process (VmHWM: its own, where ru_maxrss starts at
# the parent's size after a fork) before and after a pass over the shards in ARGV[1].
PEAK_GROWTH = """\
import re, sys
from pathlib import Path
import torch
from vllm_edsd.features.shards import iterate_batches
def peak():
    return int(re.search(r"VmHWM:\\s*(\\d+) kB", Path("/proc/self/status").read_text())[1]) * 1024
shards, before = sorted(Path(sys.argv[1]).glob("shard-*.safetensors")), peak()
batches = sum(1 for _ in iterate_batches(shards, 4, torch.Generator().manual_seed(0)))
print(batches, peak() - before)
"""


def test_reading_the_cache_holds_one_shard_at_a_time(tmp_path):
    """A pass over 10 shards of ~24 MiB raises the reading process's peak memory by a few
    shards (2 to 2.4 measured), not by the data set: an ``iterate_batches`` that read every
    shard before batching failed here (10.8 shards)."""
    spec, count, samples, length = FeatureSpec("toy", "0", (1, 2), "bfloat16", "transformers"), 10, 16, 256
    record = {"input_ids": torch.ones(length, dtype=torch.int32), "loss_mask": torch.ones(length, dtype=torch.bool),
              "aux": torch.ones(length, 2048, dtype=torch.bfloat16),
              "final": torch.ones(length, 1024, dtype=torch.bfloat16),
              "target_argmax": torch.zeros(length, dtype=torch.int32), "target_entropy": torch.zeros(length)}
    for n in range(count):
        shard_files.write_shard(tmp_path / f"shard-{n}.safetensors", [record] * samples, spec)
    shard_bytes = (tmp_path / "shard-0.safetensors").stat().st_size
    done = subprocess.run([sys.executable, "-c", PEAK_GROWTH, str(tmp_path)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr[-2000:]
    batches, growth = map(int, done.stdout.split())
    assert batches == count * samples // 4
    assert shard_bytes / 2 < growth < 4 * shard_bytes, f"peak grew by {growth / shard_bytes:.1f} shards of {count}"
