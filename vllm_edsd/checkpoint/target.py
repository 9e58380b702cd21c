"""What the project reads of a target model's config.json: the file itself
(``read_config_json``, which drafter directories are read with too), its text settings (a
multimodal model's ``text_config``), its decoder layers and the conventions their ids are
written in, the context it holds (``context_length``, ``sequence_length``), and the
fingerprint a drafter records of the target it was made for (``TargetFingerprint``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from vllm_edsd.checkpoint.files import load_json
from vllm_edsd.checkpoint.schema import check_constant, check_size
from vllm_edsd.errors import EDSDError, positive_int

# How a list of target layer ids counts the layers.
LAYER_INPUT = "layer_input"  # EAGLE / vLLM / SGLang: id l = input of decoder layer l
LAYER_OUTPUT = "layer_output"  # SpecForge: id l = output of decoder layer l = vLLM id l+1
LAYER_ID_CONVENTIONS = (LAYER_INPUT, LAYER_OUTPUT)


@dataclass(frozen=True)
class TargetFingerprint:
    """What a drafter must agree on with its target model."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int | None = None
    model_type: str | None = None

    @classmethod
    def from_hf_config(cls, cfg: Any, source: str = "the target's config") -> TargetFingerprint:
        """From a transformers config object or dict (text config of multimodal models). A missing
        vocab_size or hidden_size is refused, naming ``source``; without num_hidden_layers the
        fingerprint has no layer count, and the aux layer ids go unchecked against it."""
        get = cfg.get if isinstance(cfg, dict) else lambda key: getattr(cfg, key, None)
        return cls._checked({f.name: get(f.name) for f in fields(cls)}, source)

    @classmethod
    def from_dict(cls, d: Any, source: str = "edsd_config.target") -> TargetFingerprint | None:
        """The fingerprint a drafter's config records; a malformed one is refused by name."""
        if d is None or d == {}:
            return None
        if not isinstance(d, dict):
            raise EDSDError(f"{source}: must be an object with vocab_size and hidden_size, got {d!r:.80}")
        return cls._checked(d, source)

    @classmethod
    def _checked(cls, d: dict, source: str) -> TargetFingerprint:
        """The fingerprint of ``d``'s fields: the sizes positive integers, the model type a string."""
        def size(key: str, required: bool = True) -> int | None:
            value = d.get(key)
            if value is None and required:
                raise EDSDError(f"{source}: missing field '{key}'")
            return None if value is None else check_size(value, f"{source}: field '{key}'")

        model_type = d.get("model_type")
        if model_type is not None and not isinstance(model_type, str):
            raise EDSDError(f"{source}: field 'model_type' must be a string, got {model_type!r:.80}")
        return cls(vocab_size=size("vocab_size"), hidden_size=size("hidden_size"),
                   num_hidden_layers=size("num_hidden_layers", required=False), model_type=model_type)


def read_config_json(path: str | Path) -> dict:
    """Read ``path/config.json`` with errors that name the problem."""
    path = Path(path)
    if not path.exists():
        raise EDSDError(f"{path}: no such directory")
    if not path.is_dir():
        raise EDSDError(f"{path}: not a directory (expected a drafter directory with config.json)")
    cfg = path / "config.json"
    if not cfg.is_file():
        raise EDSDError(f"{path}: no config.json in this directory")
    raw = load_json(cfg)
    if not isinstance(raw, dict):
        raise EDSDError(f"{cfg}: expected a JSON object")
    return raw


def text_config(config: dict, source: str = "the target's config.json") -> dict:
    """A target's text settings: its config.json itself, or, for a multimodal model (a vision
    or audio tower beside the language model), the ``text_config`` it nests them in."""
    nested = config.get("text_config")
    if nested is None:
        return config
    if not isinstance(nested, dict):
        raise EDSDError(f"{source}: field 'text_config' must be an object, got {nested!r:.80}")
    return nested


def decoder_layers(path: str | Path) -> int:
    """A target's number of decoder layers (vLLM's aux id of the last layer's output), from
    its config.json (a multimodal model's text config)."""
    layers = text_config(read_config_json(path), f"{path}/config.json").get("num_hidden_layers")
    source = Path(path) / "config.json"
    if layers is None:
        raise EDSDError(f"{source}: missing field 'num_hidden_layers' (the target's number of decoder layers)")
    return check_size(layers, f"{source}: field 'num_hidden_layers'")


# Where vLLM reads a model's context from (the smallest found counts, model_max_length over all),
# and the RoPE types whose max_position_embeddings already includes the scaling (vLLM's
# ModelConfig: derive_max_model_len_and_key and _get_and_verify_max_len).
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
                "max_target_positions", "max_sequence_length", "max_seq_length", "seq_len")
SCALED_CONTEXT = ("default", "su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")


def context_length(path: str | Path) -> int | None:
    """The most tokens a target holds in one sequence, prompt and answer together, as vLLM
    derives it (its default ``max_model_len``): from the text settings of its config.json,
    scaled by a linear or dynamic RoPE factor (the tokenizer's ``model_max_length`` counts for
    vLLM's pooling models only). None when the config names no length (vLLM then assumes 2,048).
    Every stage that runs the target fits its sequences to this, so that a target with a
    short context is trained on what it can read."""
    source = f"{path}/config.json"
    config = text_config(read_config_json(path), source)
    found = {key: config[key] for key in CONTEXT_KEYS if config.get(key) is not None}
    for key, value in found.items():
        positive_int(value, f"{source}: field '{key}'")
    if not found:
        return None
    length = found.get("model_max_length", min(found.values()))
    rope = config.get("rope_parameters") or config.get("rope_scaling")
    if not isinstance(rope, dict) or "gemma3" in str(config.get("model_type")):
        return length
    if rope.get("rope_type", rope.get("type", "default")) in SCALED_CONTEXT or rope.get("factor") is None:
        return length
    return int(length * check_constant(rope["factor"], f"{source}: RoPE 'factor'"))


def sequence_length(target: str | Path, requested: int | None, default: int, flag: str, reserve: int = 0) -> int:
    """The tokens per sequence a stage runs the target on: ``requested`` (the stage's ``flag``),
    else ``default`` or, where the target's context holds fewer, as many as it holds, less the
    ``reserve`` positions the engine needs past the sequence (vLLM's feature extraction
    generates one token after each sample). A requested length the target cannot hold is
    refused in one line before any engine starts: its samples would not be the ones asked for."""
    context = context_length(target)
    most = None if context is None else context - reserve
    if requested is None:
        return default if most is None else min(default, most)
    positive_int(requested, flag)
    if most is not None and requested > most:
        spare = f", {reserve} of them kept for the token vLLM's feature extraction generates" if reserve else ""
        raise EDSDError(f"{flag} {requested}: {target} holds {context} tokens per sequence{spare}; pass {flag} "
                        f"{most} or less, or leave it out to follow the target")
    return requested
