"""Checkpoint writes that are cut off or race another run leave no drafter that looks finished."""

from __future__ import annotations

import pytest
from support.toy import make_drafter

from vllm_edsd.methods.edsd.layouts import EDSD_TRAINING


def test_a_save_cut_off_leaves_no_config_json(models, tmp_path, monkeypatch):
    """``edsd build-demo`` resumes by looking for finished checkpoints: the weights are written
    first, so an interrupted save never leaves a config.json that looks finished."""
    import vllm_edsd.checkpoint.files as files
    from vllm_edsd.checkpoint.files import finished_checkpoint

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(files, "save_safetensors", killed)
    with pytest.raises(KeyboardInterrupt):
        make_drafter(models["llama"], tmp_path / "final", layout=EDSD_TRAINING)
    assert not (tmp_path / "final" / "config.json").exists() and not finished_checkpoint(tmp_path / "final")
    assert [p.name for p in (tmp_path / "final").iterdir()] == []


def test_a_fixed_temporary_name_held_by_another_run_does_not_collide(models, tmp_path):
    """Feature shards were written to ``shard_NNNNN.tmp``: a concurrent run holding that name
    broke (or was broken by) this one."""
    from vllm_edsd.features.hidden_states import TransformersFeatures
    from vllm_edsd.features.shards import FeatureSpec, extract_features, shard_path
    from vllm_edsd.launch.transformers_target import load_target

    samples, spec = [([1, 5, 6, 7], [0, 1, 1, 1])], FeatureSpec.of(models["llama"], (1, 3), "float32", "transformers")
    shard = shard_path(tmp_path, spec, samples)
    shard.with_suffix(".tmp").mkdir()
    source = TransformersFeatures(load_target(models["llama"]), (1, 3))
    assert extract_features(source, samples, tmp_path, spec) == [shard]
    assert shard.is_file()
