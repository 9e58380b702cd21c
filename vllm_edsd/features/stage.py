"""``edsd features`` as a call: ``FeaturesOptions`` (the command's flags, with its defaults) and
``run``, which the command and the pipeline both call."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from vllm_edsd.checkpoint.target import decoder_layers

from .samples import (
    SampleOptions,
    cut_line,
    feature_shards,
    resolve_feature_layers,
    resolve_max_length,
    training_samples,
)
from .shards import manifest_path


@dataclass(frozen=True, kw_only=True)
class FeaturesOptions(SampleOptions):
    """The samples (``SampleOptions``), the cache their shards go to (``CACHE/features``, what
    ``edsd train --cache`` reads) and the layers stored: those of every drafter to train."""

    cache: str
    feature_layers: tuple[int, ...]  # vLLM's convention: the input of decoder layer l


def run(options: FeaturesOptions) -> list[Path]:
    """The samples' feature shards, extracted where missing; a manifest of them is written
    beside them."""
    layers = resolve_feature_layers(options.feature_layers, (), decoder_layers(options.target))
    cache = Path(options.cache)
    options, length_set_by = resolve_max_length(options.on_device())
    samples, read, skipped, cut = training_samples(options, cache)
    if cut:
        print(cut_line(cut, len(samples), options.max_length, length_set_by))
    shards = feature_shards(options, samples, layers, cache)
    positions = sum(len(ids) for ids, _ in samples)
    stored = sum(path.stat().st_size for path in shards)
    print(f"features: {len(samples)} samples of {read} conversations ({skipped} not renderable), {positions:,} "
          f"positions, layers {list(layers)}: {len(shards)} shards, {stored / 2**20:,.1f} MiB in {cache / 'features'}")
    print(f"manifest: {manifest_path(cache / 'features', shards)}")
    return shards
