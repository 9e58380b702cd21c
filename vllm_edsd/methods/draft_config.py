"""What every EAGLE-style drafter's config.json says (``DraftConfig``): the Llama decoder layer
it drafts with, the target's vocabulary and the draft vocabulary, RoPE, the weights' dtype and
the fingerprint of the target it was made for. Each field is declared once, with how the file
writes it, its value where the file leaves it out, its check and what it is
(``checkpoint/schema.py`` walks them); a method's own config (``methods/edsd/config.py``) adds
its fields the same way. These classes are the only place the fields are read or written, so
the converter, the trainer, the reference models and the vLLM plugin cannot disagree about one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

from vllm_edsd.checkpoint.files import SUPPORTED_DTYPES
from vllm_edsd.checkpoint.schema import Reading, check_constant, check_size, entry, read_fields
from vllm_edsd.checkpoint.target import TargetFingerprint, read_config_json
from vllm_edsd.errors import EDSDError, is_int

DEFAULT_ROPE_THETA = 10000.0  # RoPE's base where a config names none (Llama's, transformers' default)
ROPE_SCALING_FIELDS = {  # what each scaled RoPE reads, beyond rope_theta
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
# A target's fields a drafter shaped for it copies (``target_layer_fields``).
TARGET_LAYER_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "rms_norm_eps", "max_position_embeddings", "vocab_size", "rope_parameters", "rope_theta",
                     "rope_scaling")
# Two ways to norm fc's input, EAGLE 3.1's, under speculators' names (either method has both): one
# RMSNorm over the concatenated target features (``input_norm``), or one per target layer
# (``fc_norm.{i}``). One of them at most.
FC_INPUT_NORMS = ("norm_before_fc", "fc_norm")


def rope_parameters_of(raw: dict, source: str = "config.json") -> dict:
    """RoPE settings from a transformers 5 (``rope_parameters``) or 4 (``rope_theta``,
    ``rope_scaling``) config, normalised to the transformers 5 form."""
    params = raw.get("rope_parameters")
    if params is None:
        params = raw.get("rope_scaling") or {}
        if not isinstance(params, dict):
            raise EDSDError(f"{source}: field 'rope_scaling' must be an object, got {params!r:.80}")
        params = {"rope_theta": raw.get("rope_theta", DEFAULT_ROPE_THETA), **params}
    if not isinstance(params, dict):
        raise EDSDError(f"{source}: field 'rope_parameters' must be an object, got {params!r:.80}")
    params = dict(params)
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_type", "default")
    params.setdefault("rope_theta", raw.get("rope_theta", DEFAULT_ROPE_THETA))
    if not isinstance(params["rope_type"], str) or params["rope_type"] not in ("default", "llama3", "linear"):
        raise EDSDError(
            f"{source}: rope type {params['rope_type']!r} is not supported by the EDSD draft layer "
            "(supported: default, llama3, linear)"
        )
    needed = ("rope_theta", *ROPE_SCALING_FIELDS.get(params["rope_type"], ()))
    for key in needed:
        value = params.get(key)
        if not (is_int(value) or isinstance(value, float)) or not math.isfinite(value) or value <= 0:
            what = "missing" if key not in params else f"{value!r}"
            raise EDSDError(f"{source}: {params['rope_type']} RoPE needs '{key}' as a positive number, got {what}")
    if params["rope_type"] == "llama3" and params["low_freq_factor"] >= params["high_freq_factor"]:
        raise EDSDError(f"{source}: llama3 RoPE needs low_freq_factor < high_freq_factor, got "
                        f"{params['low_freq_factor']} and {params['high_freq_factor']}")
    return params


# ---------------------------------------------------------------- the fields' checks
# Each is (value, what, reading) -> the field's value; ``what`` names the file and the field.


def size(value: Any, what: str, reading: Reading) -> int:
    return check_size(value, what)


def epsilon(value: Any, what: str, reading: Reading) -> float:
    return float(check_constant(value, what))


def choice(*options: str) -> Any:
    """The check of a field that is one of ``options``."""
    def check(value: Any, what: str, reading: Reading) -> str:
        if value not in options:
            raise EDSDError(f"{what} is {value!r}; supported: {', '.join(options)}")
        return value
    return check


def flag(value: Any, what: str, reading: Reading) -> bool:
    """The check of an on/off switch: JSON's true or false, nothing that merely converts to one."""
    if not isinstance(value, bool):
        raise EDSDError(f"{what} must be true or false")
    return value


def refuse_both_fc_input_norms(switches: Mapping[str, Any], where: str,
                               spell: Callable[[str], str] = str) -> None:
    """One line where ``switches`` turns on both ``norm_before_fc`` and ``fc_norm`` (``spell``
    writes a switch's name as ``where`` knows it: a flag, a TOML key): vLLM would apply both,
    a drafter nobody trains."""
    if all(switches.get(name) for name in FC_INPUT_NORMS):
        first, second = map(spell, FC_INPUT_NORMS)
        raise EDSDError(f"{where}: {first} and {second} both norm fc's input (one RMSNorm over the target "
                        "layers together, or one per layer): turn on one of them")


def _one_layer(value: Any, what: str, reading: Reading) -> int:
    if value != 1:
        raise EDSDError(f"{what} must be 1 for an EDSD drafter, got {value!r}")
    return value


def _draft_vocab(value: Any, what: str, reading: Reading) -> int:
    vocab = reading.got["vocab_size"]
    if not is_int(value) or not 0 < value <= vocab:
        raise EDSDError(f"{what} must be an integer in 1..vocab_size={vocab}, got {value!r}")
    return value


def _heads_split(reading: Reading) -> int:
    """hidden_size split evenly among the attention heads, where the file gives no head_dim."""
    hidden, heads = reading.got["hidden_size"], reading.got["num_attention_heads"]
    if hidden % heads:
        raise EDSDError(f"{reading.source}: hidden_size={hidden} is not a multiple of num_attention_heads={heads} "
                        "(give 'head_dim' explicitly if the attention width differs from hidden_size)")
    return hidden // heads


def _head_dim(value: Any, what: str, reading: Reading) -> int:
    value = check_size(value, what)
    if value % 2:
        raise EDSDError(f"{what} must be even (RoPE rotates pairs), got {value}")
    return value


def _kv_heads(value: Any, what: str, reading: Reading) -> int:
    value, heads = check_size(value, what), reading.got["num_attention_heads"]
    if heads % value:
        raise EDSDError(
            f"{reading.source}: num_attention_heads={heads} is not a multiple of num_key_value_heads={value}"
        )
    return value


def _silu(value: Any, what: str, reading: Reading) -> str:
    if value != "silu":
        raise EDSDError(f"{what} is {value!r}; the EDSD draft layer is a SwiGLU (silu)")
    return value


def _fingerprint(value: Any, what: str, reading: Reading) -> TargetFingerprint | None:
    return TargetFingerprint.from_dict(value, what)


def _dtype(reading: Reading) -> Any:
    """transformers 4 writes ``torch_dtype``, 5 ``dtype``."""
    return reading.raw.get("torch_dtype") or reading.raw.get("dtype") or "float32"


def _default_rope() -> dict:
    return {"rope_type": "default", "rope_theta": DEFAULT_ROPE_THETA}


@dataclass(frozen=True, kw_only=True)
class DraftConfig:
    """The draft decoder layer and vocabularies of an EAGLE-style drafter. The fields are read
    in this order, so a file's first problem in it is the one reported."""

    BLOCK: ClassVar[str | None] = None  # the method's own block of config.json, where its own fields are

    hidden_size: int = entry("the draft layer's width d", check=size)
    num_attention_heads: int = entry("its query heads", check=size)
    num_hidden_layers: int = entry("decoder layers: a drafter has one", default=1, null_absent=False,
                                   check=_one_layer)
    vocab_size: int = entry("the target's vocabulary", check=size)
    draft_vocab_size: int = entry("the draft head's vocabulary (a part of the target's, mapped by d2t)",
                                  absent=lambda reading: reading.got["vocab_size"], check=_draft_vocab)
    head_dim: int = entry("an attention head's width; even, for RoPE", absent=_heads_split, check=_head_dim)
    torch_dtype: str = entry("the weights' dtype", default="float32", read=_dtype, check=choice(*SUPPORTED_DTYPES))
    hidden_act: str = entry("the MLP's activation: the draft layer is a SwiGLU", default="silu", null_absent=False,
                            check=_silu)
    num_key_value_heads: int = entry("key/value heads, each serving a whole group of query heads",
                                     absent=lambda reading: reading.got["num_attention_heads"], check=_kv_heads)
    intermediate_size: int = entry("the draft layer's MLP width", check=size)
    target_hidden_size: int = entry("the width of one target feature (a target layer's hidden state)",
                                    absent=lambda reading: reading.got["hidden_size"], check=size)
    rms_norm_eps: float = entry("the RMSNorms' epsilon", default=1e-5, check=epsilon)
    rope_parameters: dict = entry("RoPE, in transformers 5's form", default_factory=_default_rope,
                                  read=lambda reading: rope_parameters_of(reading.raw, reading.source))
    max_position_embeddings: int = entry("the positions RoPE is laid out for", default=2048, check=size)
    target: TargetFingerprint | None = entry("what the drafter records of the target it was made for",
                                             default=None, block=True, check=_fingerprint)

    # ---------------------------------------------------------------- reading
    @classmethod
    def from_dict(cls, raw: Any, *, source: str = "config.json", **options: Any) -> DraftConfig:
        """Validate a config.json dict; ``source`` names it in errors."""
        cls.check_file(raw, source)
        return cls(**read_fields(cls, raw, source, block=cls.BLOCK, **options))

    @classmethod
    def from_dir(cls, path: str | Path, **options: Any) -> DraftConfig:
        return cls.from_dict(read_config_json(path), source=str(Path(path) / "config.json"), **options)

    @classmethod
    def check_file(cls, raw: Any, source: str) -> None:
        """What makes ``raw`` a config of this kind at all, before its fields are read."""
        if not isinstance(raw, dict):
            raise EDSDError(f"{source}: expected a JSON object, got {type(raw).__name__}")

    @staticmethod
    def target_layer_fields(t: dict, fingerprint: TargetFingerprint, *, draft_vocab_size: int | None,
                            intermediate_size: int | None) -> dict:
        """The config.json fields of a draft layer shaped for a target's text settings ``t``
        (docs/formats.md defaults: d = d_t, m = the target's FFN width, the target's attention
        geometry and RoPE), before the method adds its block."""
        raw = {k: t[k] for k in TARGET_LAYER_KEYS if t.get(k) is not None}
        raw.update(num_hidden_layers=1, torch_dtype="float32",
                   draft_vocab_size=fingerprint.vocab_size if draft_vocab_size is None else draft_vocab_size)
        if intermediate_size:
            raw["intermediate_size"] = intermediate_size
        return raw

    # ---------------------------------------------------------------- writing
    def llama_fields(self) -> dict:
        """The Llama hyper-parameters of the draft decoder layer, as config.json writes them."""
        out = {
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": self.hidden_act,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "tie_word_embeddings": False,
            "torch_dtype": self.torch_dtype,
            "rope_parameters": dict(self.rope_parameters),
        }
        # transformers 4.x readers look for these two.
        out["rope_theta"] = self.rope_parameters.get("rope_theta", DEFAULT_ROPE_THETA)
        if self.rope_parameters.get("rope_type", "default") != "default":
            out["rope_scaling"] = dict(self.rope_parameters)
        if self.target_hidden_size != self.hidden_size:
            out["target_hidden_size"] = self.target_hidden_size
        return out

    def with_updates(self, **changes: Any) -> DraftConfig:
        return replace(self, **changes)

    # ---------------------------------------------------------------- checking
    @property
    def carries_embedding(self) -> bool:
        """Whether a checkpoint must carry its own embedding table; else it shares the target's."""
        return False

    def layers_read(self) -> tuple[int, ...]:
        """The target layers the config records the drafter reads (vLLM's convention); () where
        it records none."""
        return ()

    def check_target(self, target: TargetFingerprint, *, drafter: str = "drafter",
                     aux_layer_ids: tuple[int, ...] | None = None) -> None:
        """Refuse a target this drafter was not made for, naming the mismatch. ``aux_layer_ids``:
        the target layers the drafter reads, where its config does not record them (EAGLE-3's)."""
        ids = self.layers_read() if aux_layer_ids is None else tuple(aux_layer_ids)
        problems = []
        if self.vocab_size != target.vocab_size:
            problems.append(f"vocab_size: drafter {self.vocab_size}, target {target.vocab_size}")
        if self.target_hidden_size != target.hidden_size:
            problems.append(
                f"hidden size: drafter reads target features of size {self.target_hidden_size}, "
                f"target hidden_size is {target.hidden_size}"
            )
        n = target.num_hidden_layers
        if n is not None:
            bad = [i for i in ids if i > n]
            if bad:
                problems.append(
                    f"aux layer ids {list(ids)} (vLLM convention: input of layer i): "
                    f"{bad} do not exist in a target with {n} layers (valid: 0..{n})"
                )
            fp = self.target
            if fp is not None and fp.num_hidden_layers is not None and fp.num_hidden_layers != n:
                problems.append(
                    f"num_hidden_layers: drafter was made for a target with {fp.num_hidden_layers} "
                    f"layers, this target has {n}"
                )
        if problems:
            raise EDSDError(f"{drafter} does not fit the target model: " + "; ".join(problems))

