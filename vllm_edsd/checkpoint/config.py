"""The EDSD draft configuration: one parser and validator for every checkpoint layout.

This project's training layout (docs/formats.md) and the vLLM layout (docs/formats.md) share the Llama
hyper-parameters of the draft decoder layer plus an ``edsd_config`` block; SpecForge's
config is translated into that form by ``layouts.py`` first. This module is the only place
that reads or writes the fields, so the converter, the trainer, the reference model and the
vLLM plugin cannot disagree about one.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from vllm_edsd.checkpoint.files import load_json
from vllm_edsd.errors import EDSDError, first_line, is_int, positive_int

# No size, count or constant of a drafter reaches 2**31: a larger one is a typo or an attack,
# and would overflow an int32 index or an allocation further on.
MAX_FIELD = 2**31

LAYER_INPUT = "layer_input"  # EAGLE / vLLM / SGLang: id l = input of decoder layer l
LAYER_OUTPUT = "layer_output"  # SpecForge: id l = output of decoder layer l = vLLM id l+1
LAYER_ID_CONVENTIONS = (LAYER_INPUT, LAYER_OUTPUT)

SUPPORTED_DTYPES = ("float32", "float16", "bfloat16")  # a drafter's weights; a target's while its features are read
DEFAULT_ROPE_THETA = 10000.0  # RoPE's base where a config names none (Llama's, transformers' default)

# The norm EDFuse applies to the token embedding. SpecForge's EDSD (what the paper's drafters
# were trained with) uses an RMSNorm; the paper's prose describes a LayerNorm with bias.
RMSNORM = "rmsnorm"
LAYERNORM = "layernorm"
TOKEN_NORMS = (RMSNORM, LAYERNORM)
# A config written before the field existed had the LayerNorm.
LEGACY_TOKEN_NORM = LAYERNORM

# The speculators format (docs/formats.md, "Speculators format"): vLLM takes a drafter
# directory's ``speculators_model_type`` as the speculative method, so it is the plugin's method.
SPECULATORS_MODEL_TYPE = "edsd"
DEFAULT_SPECULATIVE_TOKENS = 4
MAX_SPECULATIVE_TOKENS = 16  # a one-layer drafter's acceptance is spent long before
PROPOSAL_TYPE = "greedy"  # the speculators name of vLLM's chain drafting


def check_size(value: Any, what: str) -> int:
    """A size or count of a drafter: a positive integer below 2**31."""
    return _below_max_field(positive_int(value, what), what)


def check_constant(value: Any, what: str) -> int | float:
    """A positive number below 2**31 (an epsilon, a RoPE base); NaN and infinity are refused."""
    if not (is_int(value) or isinstance(value, float)) or not value > 0:  # NaN too
        raise EDSDError(f"{what} must be a positive number, got {value!r:.40}")
    return _below_max_field(value, what)


def _below_max_field(value: int | float, what: str) -> int | float:
    """No size, count or constant of a drafter reaches 2**31 (MAX_FIELD)."""
    if not value < MAX_FIELD:  # infinity, and sizes that overflow further on
        raise EDSDError(f"{what} must be below 2**31, got {value!r:.40}")
    return value


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


def check_speculative_tokens(k: Any, what: str) -> int:
    """The draft length K a drafter directory proposes: 1..MAX_SPECULATIVE_TOKENS."""
    if not is_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise EDSDError(f"{what} must be an integer in 1..{MAX_SPECULATIVE_TOKENS}, got {k!r:.40}")
    return k


@dataclass(frozen=True)
class Speculators:
    """What vLLM needs to serve a drafter directory alone (``vllm serve DRAFTER_DIR``): the target
    it loads, which the speculators format calls the *verifier*, and the draft length K
    (docs/formats.md, "Speculators format")."""

    verifier: str
    num_speculative_tokens: int = DEFAULT_SPECULATIVE_TOKENS
    verifier_architectures: tuple[str, ...] = ()

    @classmethod
    def from_config(cls, raw: dict, source: str) -> Speculators | None:
        """The block of a config.json, None where it has none; a malformed one is refused by name."""
        if "speculators_config" not in raw and "speculators_model_type" not in raw:
            return None
        kind = raw.get("speculators_model_type")
        if kind != SPECULATORS_MODEL_TYPE:
            raise EDSDError(f"{source}: field 'speculators_model_type' must be {SPECULATORS_MODEL_TYPE!r} for an "
                            f"EDSD drafter, got {kind!r:.80}")
        try:
            block = raw["speculators_config"]
            k, verifier = block["proposal_methods"][0]["speculative_tokens"], block["verifier"]
            name, architectures = verifier["name_or_path"], verifier.get("architectures") or []
        except (KeyError, IndexError, TypeError, AttributeError) as exc:  # which part is missing: the clue
            raise EDSDError(f"{source}: field 'speculators_config' must hold proposal_methods[0].speculative_tokens "
                            f"and verifier.name_or_path (docs/formats.md) ({type(exc).__name__}: "
                            f"{first_line(exc)})") from exc
        if not isinstance(name, str) or not name:
            raise EDSDError(f"{source}: field 'speculators_config.verifier.name_or_path' must name the target "
                            f"model (a directory or a hub id), got {name!r:.80}")
        if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
            raise EDSDError(f"{source}: field 'speculators_config.verifier.architectures' must list names, "
                            f"got {architectures!r:.80}")
        if not isinstance(raw.get("transformer_layer_config"), dict):
            raise EDSDError(f"{source}: field 'transformer_layer_config' must be an object (vLLM requires it)")
        k = check_speculative_tokens(k, f"{source}: field 'speculators_config.proposal_methods[0].speculative_tokens'")
        return cls(verifier=name, num_speculative_tokens=k, verifier_architectures=tuple(architectures))

    def to_dict(self, layer_fields: dict) -> dict:
        """The speculators fields of config.json around the draft layer's Llama fields."""
        proposal = {"proposal_type": PROPOSAL_TYPE, "speculative_tokens": self.num_speculative_tokens}
        return {
            "speculators_model_type": SPECULATORS_MODEL_TYPE,
            "speculators_config": {
                "algorithm": SPECULATORS_MODEL_TYPE,
                "proposal_methods": [proposal],
                "default_proposal_method": PROPOSAL_TYPE,
                "verifier": {"name_or_path": self.verifier, "architectures": list(self.verifier_architectures)},
            },
            "transformer_layer_config": layer_fields,
        }


@dataclass(frozen=True)
class EDSDConfig:
    """Hyper-parameters of an EDSD drafter, aux layer ids always in vLLM's convention."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    fuse_intermediate_size: int
    aux_layer_ids: tuple[int, int]
    rms_norm_eps: float = 1e-5
    token_norm: str = RMSNORM
    token_norm_eps: float = 1e-5
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": DEFAULT_ROPE_THETA})
    max_position_embeddings: int = 2048
    hidden_act: str = "silu"
    token_norm_folded: bool = False
    torch_dtype: str = "float32"
    target: TargetFingerprint | None = None
    # Provenance, written by the converter into the vLLM layout.
    metadata: dict = field(default_factory=dict)
    # The vLLM layout's speculators block, where the converter knew the verifier.
    speculators: Speculators | None = None

    # ---------------------------------------------------------------- parsing
    @classmethod
    def from_dict(
        cls,
        raw: dict,
        *,
        source: str = "config.json",
        layer_id_convention: str | None = None,
    ) -> EDSDConfig:
        """Validate a config.json dict of either layout.

        ``layer_id_convention`` overrides the convention recorded in the file (the
        converter's ``--layer-id-convention``); the result always holds vLLM ids.
        """
        edsd = _edsd_block_of(raw, source)
        reader = _FieldReader(source)
        hidden = reader.need(raw, "hidden_size", int)
        heads = reader.need(raw, "num_attention_heads", int)
        _check_one_layer(raw, source)
        vocab = reader.need(raw, "vocab_size", int)
        # Keyword arguments are evaluated in order: the first problem of a file is the one reported.
        return cls(
            hidden_size=hidden,
            num_attention_heads=heads,
            vocab_size=vocab,
            draft_vocab_size=_draft_vocab_size(raw, vocab, source),
            head_dim=_head_dim(raw, hidden, heads, reader),
            aux_layer_ids=_vllm_aux_layer_ids(edsd, layer_id_convention, source),
            torch_dtype=_dtype(raw, source),
            hidden_act=_hidden_act(raw, source),
            num_key_value_heads=_kv_heads(raw, heads, reader),
            token_norm_folded=_token_norm_folded(edsd, source),
            token_norm=_token_norm(edsd, source),
            intermediate_size=reader.need(raw, "intermediate_size", int),
            target_hidden_size=reader.optional(raw, "target_hidden_size", int, hidden),
            fuse_intermediate_size=reader.need(edsd, "fuse_intermediate_size", int, "edsd_config."),
            rms_norm_eps=float(reader.optional(raw, "rms_norm_eps", float, 1e-5)),
            token_norm_eps=float(reader.optional(edsd, "token_norm_eps", float, 1e-5, "edsd_config.")),
            rope_parameters=rope_parameters_of(raw, source),
            max_position_embeddings=reader.optional(raw, "max_position_embeddings", int, 2048),
            target=TargetFingerprint.from_dict(edsd.get("target"), f"{source}: field 'edsd_config.target'"),
            metadata={k: v for k, v in edsd.items() if k in ("converter", "source")},
            speculators=Speculators.from_config(raw, source),
        )

    @classmethod
    def from_dir(cls, path: str | Path, **kwargs: Any) -> EDSDConfig:
        return cls.from_dict(read_config_json(path), source=str(Path(path) / "config.json"), **kwargs)

    @classmethod
    def for_target(
        cls,
        target: dict,
        aux_layer_ids: tuple[int, int],
        *,
        draft_vocab_size: int | None = None,
        fuse_intermediate_size: int | None = None,
        intermediate_size: int | None = None,
        token_norm: str = RMSNORM,
        source: str = "the target's config.json",
    ) -> EDSDConfig:
        """A drafter shaped for a target's ``config.json`` (docs/formats.md defaults: d = d_t,
        m = the target's FFN width, the target's attention geometry and RoPE; the token
        norm of SpecForge's EDSD unless asked otherwise). ``source`` names the target's file
        in errors."""
        t = text_config(target, source)
        fingerprint = TargetFingerprint.from_hf_config(t, source)
        copied = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                  "rms_norm_eps", "max_position_embeddings", "vocab_size", "rope_parameters", "rope_theta",
                  "rope_scaling")
        raw = {k: t[k] for k in copied if t.get(k) is not None}
        raw.update(
            num_hidden_layers=1,
            draft_vocab_size=t["vocab_size"] if draft_vocab_size is None else draft_vocab_size,
            torch_dtype="float32",
            edsd_config={
                "aux_layer_ids": list(aux_layer_ids),
                "aux_layer_id_convention": LAYER_INPUT,
                "fuse_intermediate_size": fuse_intermediate_size or t.get("intermediate_size"),
                "token_norm": token_norm,
                "token_norm_eps": t.get("rms_norm_eps", 1e-5),
                "target": {k: v for k, v in asdict(fingerprint).items() if v is not None},
            },
        )
        if intermediate_size:
            raw["intermediate_size"] = intermediate_size
        cfg = cls.from_dict(raw, source=f"drafter config for {source}")
        cfg.check_target(fingerprint)
        return cfg

    # ---------------------------------------------------------------- writing
    def llama_fields(self) -> dict:
        """The Llama hyper-parameters of the draft decoder layer, as config.json writes them."""
        out = {
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": 1,
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

    def _edsd_block(self, convention: str) -> dict:
        shift = 1 if convention == LAYER_OUTPUT else 0
        block = {
            "aux_layer_ids": [i - shift for i in self.aux_layer_ids],
            "aux_layer_id_convention": convention,
            "fuse_intermediate_size": self.fuse_intermediate_size,
            "token_norm": self.token_norm,
            "token_norm_eps": self.token_norm_eps,
            "token_norm_folded": self.token_norm_folded,
        }
        if self.target is not None:
            block["target"] = {k: v for k, v in asdict(self.target).items() if v is not None}
        block.update(self.metadata)
        return block

    def to_training_dict(self, architecture: str) -> dict:
        """config.json of the training layout (docs/formats.md), ids in vLLM's convention."""
        return {
            "architectures": [architecture],
            **self.llama_fields(),
            "edsd_config": self._edsd_block(LAYER_INPUT),
        }

    def to_vllm_dict(self, architecture: str) -> dict:
        """config.json of the vLLM layout (docs/formats.md), with the speculators block where
        the verifier is known."""
        ids = list(self.aux_layer_ids)
        out = {
            "architectures": [architecture],
            **self.llama_fields(),
            "eagle_aux_hidden_state_layer_ids": ids,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
            "edsd_config": self._edsd_block(LAYER_INPUT),
        }
        if self.speculators is not None:
            out.update(self.speculators.to_dict(self.llama_fields()))
        return out

    def with_updates(self, **changes: Any) -> EDSDConfig:
        return replace(self, **changes)

    # ------------------------------------------------------------- checking
    def check_target(self, target: TargetFingerprint, *, drafter: str = "drafter") -> None:
        """Refuse a target this drafter was not made for, naming the mismatch."""
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
            bad = [i for i in self.aux_layer_ids if i > n]
            if bad:
                problems.append(
                    f"aux layer ids {list(self.aux_layer_ids)} (vLLM convention: input of layer i): "
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


class _FieldReader:
    """Reads the numeric fields of one config.json, each refused by name when missing or malformed."""

    def __init__(self, source: str) -> None:
        self.source = source

    def need(self, block: dict, key: str, kind: type, where: str = "") -> Any:
        """A required field: a size (``int``) or a constant (``float``), positive and below 2**31."""
        if key not in block:
            raise EDSDError(f"{self.source}: missing field '{where}{key}'")
        what = f"{self.source}: field '{where}{key}'"
        return check_size(block[key], what) if kind is int else check_constant(block[key], what)

    def optional(self, block: dict, key: str, kind: type, default: Any, where: str = "") -> Any:
        """A field that may be absent (or null): then ``default``; else checked as ``need`` does."""
        return default if block.get(key) is None else self.need(block, key, kind, where)


def _edsd_block_of(raw: Any, source: str) -> dict:
    """The ``edsd_config`` block, which makes a config.json an EDSD drafter's."""
    if not isinstance(raw, dict):
        raise EDSDError(f"{source}: expected a JSON object, got {type(raw).__name__}")
    edsd = raw.get("edsd_config")
    if not isinstance(edsd, dict):
        raise EDSDError(
            f"{source}: no 'edsd_config' block; this is not an EDSD drafter "
            f"(architectures={raw.get('architectures')})"
        )
    return edsd


def _check_one_layer(raw: dict, source: str) -> None:
    """An EDSD drafter is one decoder layer; a config without the field is one."""
    layers = raw.get("num_hidden_layers", 1)
    if layers != 1:
        raise EDSDError(f"{source}: field 'num_hidden_layers' must be 1 for an EDSD drafter, got {layers!r}")


def _draft_vocab_size(raw: dict, vocab: int, source: str) -> int:
    """The draft vocabulary: the target's whole vocabulary unless the config names a part."""
    draft_vocab = raw.get("draft_vocab_size")
    draft_vocab = vocab if draft_vocab is None else draft_vocab
    if not is_int(draft_vocab) or not 0 < draft_vocab <= vocab:
        raise EDSDError(
            f"{source}: field 'draft_vocab_size' must be an integer in 1..vocab_size={vocab}, got {draft_vocab!r}"
        )
    return draft_vocab


def _head_dim(raw: dict, hidden: int, heads: int, reader: _FieldReader) -> int:
    """The attention heads' width: given, or hidden_size split evenly among the heads; even for RoPE."""
    if raw.get("head_dim") is None and hidden % heads:
        raise EDSDError(f"{reader.source}: hidden_size={hidden} is not a multiple of num_attention_heads={heads} "
                        "(give 'head_dim' explicitly if the attention width differs from hidden_size)")
    head_dim = reader.optional(raw, "head_dim", int, hidden // heads)
    if head_dim % 2:
        raise EDSDError(f"{reader.source}: field 'head_dim' must be even (RoPE rotates pairs), got {head_dim}")
    return head_dim


def _kv_heads(raw: dict, heads: int, reader: _FieldReader) -> int:
    """The key/value heads (all heads unless given): each serves a whole group of query heads."""
    kv_heads = reader.optional(raw, "num_key_value_heads", int, heads)
    if heads % kv_heads:
        raise EDSDError(
            f"{reader.source}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
        )
    return kv_heads


def _layer_id_convention(edsd: dict, override: str | None, source: str) -> str:
    """The convention of the file's aux layer ids: ``override`` (``--layer-id-convention``), else the recorded one."""
    convention = override or edsd.get("aux_layer_id_convention")
    if convention is None:
        raise EDSDError(
            f"{source}: field 'edsd_config.aux_layer_id_convention' is missing; pass "
            f"--layer-id-convention {LAYER_INPUT}|{LAYER_OUTPUT} (SpecForge checkpoints record "
            f"'{LAYER_OUTPUT}': the output of layer i, which is vLLM's id i+1)"
        )
    if convention not in LAYER_ID_CONVENTIONS:
        raise EDSDError(
            f"{source}: aux layer id convention {convention!r} is not one of {LAYER_ID_CONVENTIONS}"
        )
    return convention


def _vllm_aux_layer_ids(edsd: dict, override: str | None, source: str) -> tuple[int, int]:
    """The two aux layer ids, translated into vLLM's convention and sorted."""
    convention = _layer_id_convention(edsd, override, source)
    ids = edsd.get("aux_layer_ids")
    if not isinstance(ids, (list, tuple)) or len(ids) != 2 or not all(is_int(i) and i >= 0 for i in ids):
        raise EDSDError(
            f"{source}: field 'edsd_config.aux_layer_ids' must list exactly two non-negative "
            f"target layer ids, got {ids!r}"
        )
    shift = 1 if convention == LAYER_OUTPUT else 0
    low, high = sorted(i + shift for i in ids)
    if low == high:
        raise EDSDError(f"{source}: field 'edsd_config.aux_layer_ids' names the same layer twice: {ids!r}")
    return low, high


def _dtype(raw: dict, source: str) -> str:
    """The weights' dtype (transformers 4 writes ``torch_dtype``, 5 ``dtype``), float32 unless given."""
    dtype = raw.get("torch_dtype") or raw.get("dtype") or "float32"
    if dtype not in SUPPORTED_DTYPES:
        raise EDSDError(f"{source}: field 'torch_dtype' is {dtype!r}; supported: {', '.join(SUPPORTED_DTYPES)}")
    return dtype


def _hidden_act(raw: dict, source: str) -> str:
    """The MLP's activation: only silu, the draft layer's SwiGLU."""
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise EDSDError(f"{source}: field 'hidden_act' is {act!r}; the EDSD draft layer is a SwiGLU (silu)")
    return act


def _token_norm_folded(edsd: dict, source: str) -> bool:
    """Whether the token norm is folded into a draft-owned embedding table (``edsd convert --fold-token-norm``)."""
    folded = edsd.get("token_norm_folded", False)
    if not isinstance(folded, bool):
        raise EDSDError(f"{source}: field 'edsd_config.token_norm_folded' must be true or false")
    return folded


def _token_norm(edsd: dict, source: str) -> str:
    """EDFuse's norm of the token embedding; a config without the field predates it and had a LayerNorm."""
    token_norm = edsd.get("token_norm", LEGACY_TOKEN_NORM)
    if token_norm not in TOKEN_NORMS:
        raise EDSDError(
            f"{source}: field 'edsd_config.token_norm' is {token_norm!r}; supported: {', '.join(TOKEN_NORMS)}"
        )
    return token_norm


ROPE_SCALING_FIELDS = {  # what each scaled RoPE reads, beyond rope_theta
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


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
