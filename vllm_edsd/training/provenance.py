"""Whether a finished training run is what given ``edsd train`` options would train: its recipe
(the training state records it) and its drafter's shape (the final checkpoint's config), so that
a run trained elsewhere, such as a learning-curve point, can stand for a pipeline's own
(``edsd build-demo --ship-from``)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from vllm_edsd.checkpoint.target import decoder_layers, read_config_json
from vllm_edsd.methods import method

from .checkpointing import STATE_FILE, read_state, saved_recipe
from .drafter import draft_config, resolve_layers
from .options import TrainOptions
from .recipe import Recipe

WIDTHS = ("intermediate_size", "fuse_intermediate_size")  # the draft layer's FFN, EDFuse's (EDSD's alone)


def differences(run: Path, options: TrainOptions) -> list[str]:
    """What of the finished run in ``run`` differs from what ``options`` would train, a phrase
    each (empty where nothing does). The data it read and how often it saved are not compared."""
    state = run / STATE_FILE
    if not state.is_file():
        return [f"no {STATE_FILE}, where a run records its recipe"]
    trained = saved_recipe(read_state(state))
    found = [f"{name} {trained.get(name)!r} (the recipe's: {value!r})"
             for name, value in asdict(Recipe.from_options(options)).items() if trained.get(name) != value]
    drafting = method(options.method)
    _, model = drafting.model.unloaded(run / "final")
    layers = resolve_layers(options, decoder_layers(options.target))
    if model.aux_layer_ids != layers:
        found.append(f"aux layers {list(model.aux_layer_ids)} (the recipe's: {list(layers)})")
    if options.draft_vocab_size is not None and model.config.draft_vocab_size != options.draft_vocab_size:
        found.append(f"draft vocabulary {model.config.draft_vocab_size} (the recipe's: {options.draft_vocab_size})")
    built = draft_config(options, read_config_json(options.target), layers, model.config.draft_vocab_size)
    wanted = {name: getattr(options, name) for name in drafting.own_train_fields if name not in WIDTHS}
    # the widths: the recipe's, or the target's where it sets none
    wanted |= {name: getattr(built, name) for name in WIDTHS if hasattr(model.config, name)}
    return found + [f"{name} {getattr(model.config, name)!r} (the recipe's: {value!r})"
                    for name, value in wanted.items() if getattr(model.config, name) != value]
