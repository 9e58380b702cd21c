"""EDSD's config.json: the draft layer every EAGLE-style drafter has (``DraftConfig``) and, in
the ``edsd_config`` block, EDSD's own fields: the two aux layers (``aux_layer_ids`` in vLLM's
convention), EDFuse's width, the token norm and whether it is folded into the embedding, and
where the converter knew the verifier, the speculators block (``Speculators``) that lets vLLM
serve the drafter directory alone.

This project's training layout and the vLLM layout (docs/formats.md) write these fields;
SpecForge's config is translated into that form by ``layouts.py`` first.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, ClassVar

from vllm_edsd.checkpoint.schema import REQUIRED, Reading, entry, read_fields
from vllm_edsd.checkpoint.target import LAYER_ID_CONVENTIONS, LAYER_INPUT, LAYER_OUTPUT, TargetFingerprint, text_config
from vllm_edsd.errors import EDSDError, first_line, is_int
from vllm_edsd.methods.draft_config import (
    FC_INPUT_NORMS,
    DraftConfig,
    choice,
    epsilon,
    flag,
    refuse_both_fc_input_norms,
    size,
)
from vllm_edsd.methods.registry import EDSD

# The norm EDFuse applies to the token embedding. SpecForge's EDSD (what the paper's drafters
# were trained with) uses an RMSNorm; the paper's prose describes a LayerNorm with bias.
RMSNORM = "rmsnorm"
LAYERNORM = "layernorm"
TOKEN_NORMS = (RMSNORM, LAYERNORM)
# A config written before the field existed had the LayerNorm.
LEGACY_TOKEN_NORM = LAYERNORM
# The draft layer's changes beyond the paper; fc's input norms are EAGLE 3.1's, under its names.
SWITCHES = ("attention_reads_token", "feature_norm", "fuse_residual", "norm_before_residual", *FC_INPUT_NORMS)
# Why a token-reading drafter is never folded (edsd convert and the config check say it alike).
FOLD_CONFLICT = ("this drafter's attention also reads the token through its own norm of the raw embedding "
                 "(edsd_config.attention_reads_token), which a folded table would change")
PROVENANCE = ("converter", "source")  # what the converter records of how it made the drafter

# The speculators format (docs/formats.md, "Speculators format"): vLLM takes a drafter
# directory's ``speculators_model_type`` as the speculative method, so it is the plugin's method.
SPECULATORS_MODEL_TYPE = EDSD
DEFAULT_SPECULATIVE_TOKENS = 4
MAX_SPECULATIVE_TOKENS = 16  # a one-layer drafter's acceptance is spent long before
PROPOSAL_TYPE = "greedy"  # the speculators name of vLLM's chain drafting
VERIFIER = ("speculators_config", "verifier")
PROPOSAL = ("speculators_config", "proposal_methods", 0)


def check_speculative_tokens(k: Any, what: str) -> int:
    """The draft length K a drafter directory proposes: 1..MAX_SPECULATIVE_TOKENS."""
    if not is_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise EDSDError(f"{what} must be an integer in 1..{MAX_SPECULATIVE_TOKENS}, got {k!r:.40}")
    return k


def _verifier_name(name: Any, what: str, reading: Reading) -> str:
    if not isinstance(name, str) or not name:
        raise EDSDError(f"{what} must name the target model (a directory or a hub id), got {name!r:.80}")
    return name


def _names(names: Any, what: str, reading: Reading) -> tuple[str, ...]:
    names = names or []
    if not isinstance(names, list) or not all(isinstance(a, str) for a in names):
        raise EDSDError(f"{what} must list names, got {names!r:.80}")
    return tuple(names)


def _malformed_speculators(path: tuple, reading: Reading, exc: Exception) -> None:
    """A part of the block missing: the block's shape is the error, which part the clue."""
    raise EDSDError(f"{reading.source}: field 'speculators_config' must hold proposal_methods[0].speculative_tokens "
                    f"and verifier.name_or_path (docs/formats.md) ({type(exc).__name__}: "
                    f"{first_line(exc)})") from exc


@dataclass(frozen=True, kw_only=True)
class Speculators:
    """What vLLM needs to serve a drafter directory alone (``vllm serve DRAFTER_DIR``): the target
    it loads, which the speculators format calls the *verifier*, and the draft length K
    (docs/formats.md, "Speculators format"). The fields are read in this order."""

    num_speculative_tokens: int = entry(
        "the draft length K", default=DEFAULT_SPECULATIVE_TOKENS, absent=REQUIRED,
        path=(*PROPOSAL, "speculative_tokens"),
        check=lambda k, what, reading: check_speculative_tokens(k, what))
    verifier: str = entry("the target vLLM loads: a directory or a hub id", path=(*VERIFIER, "name_or_path"),
                          check=_verifier_name)
    verifier_architectures: tuple[str, ...] = entry("the verifier's architectures", default=(),
                                                    path=(*VERIFIER, "architectures"), check=_names)

    @classmethod
    def from_config(cls, raw: dict, source: str) -> Speculators | None:
        """The block of a config.json, None where it has none; a malformed one is refused by name."""
        if "speculators_config" not in raw and "speculators_model_type" not in raw:
            return None
        kind = raw.get("speculators_model_type")
        if kind != SPECULATORS_MODEL_TYPE:
            raise EDSDError(f"{source}: field 'speculators_model_type' must be {SPECULATORS_MODEL_TYPE!r} for an "
                            f"EDSD drafter, got {kind!r:.80}")
        values = read_fields(cls, raw, source, missing=_malformed_speculators)
        if not isinstance(raw.get("transformer_layer_config"), dict):
            raise EDSDError(f"{source}: field 'transformer_layer_config' must be an object (vLLM requires it)")
        return cls(**values)

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


def _vllm_aux_layer_ids(reading: Reading) -> tuple[int, int]:
    """The two aux layer ids, translated into vLLM's convention and sorted."""
    edsd, source = reading.own_block(), reading.source
    convention = _layer_id_convention(edsd, reading.options.get("layer_id_convention"), source)
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


@dataclass(frozen=True, kw_only=True)
class EDSDConfig(DraftConfig):
    """Hyper-parameters of an EDSD drafter, aux layer ids always in vLLM's convention. Its own
    fields are read after the draft layer's, from the ``edsd_config`` block."""

    BLOCK: ClassVar[str] = "edsd_config"

    aux_layer_ids: tuple[int, int] = entry("the two target layers EDFuse reads (vLLM's id l: input of layer l)",
                                           read=_vllm_aux_layer_ids)
    token_norm_folded: bool = entry("the token norm folded into a draft-owned embedding table "
                                    "(edsd convert --fold-token-norm)", default=False, block=True,
                                    null_absent=False, check=flag)
    # A config without the field predates it and had a LayerNorm.
    token_norm: str = entry("EDFuse's norm of the token embedding", default=RMSNORM, absent=LEGACY_TOKEN_NORM,
                            block=True, null_absent=False, check=choice(*TOKEN_NORMS))
    fuse_intermediate_size: int = entry("EDFuse's gated MLP width", block=True, check=size)
    token_norm_eps: float = entry("the token norm's epsilon", default=1e-5, block=True, check=epsilon)
    # Beyond the paper (docs/paper.md, "The draft layer's attention input"); off, the paper's design.
    attention_reads_token: bool = entry("the draft layer's q/k/v read [input_layernorm(u); token_norm(e)]: the "
                                        "token beside the fused stream", default=False, block=True,
                                        null_absent=False, check=flag)
    feature_norm: bool = entry("EDFuse's gate reads RMSNorm(g): the fed-back state stays bounded", default=False,
                               block=True, null_absent=False, check=flag)
    fuse_residual: bool = entry("EDFuse adds its feature input to its output, u = g + EDFuse(g, e) (g normed "
                                "first with feature_norm): the fed-back state reaches the draft layer past the "
                                "gate", default=False, block=True, null_absent=False, check=flag)
    norm_before_residual: bool = entry("the draft layer's residual is input_layernorm(u), the stream its attention "
                                       "reads, not u (EAGLE 3.1's name)", default=False, block=True,
                                       null_absent=False, check=flag)
    # EAGLE 3.1's norms of fc's input (``FC_INPUT_NORMS``): the target's features reach fc unnormalised
    # otherwise (the first token's massive activation among them). One of the two at most.
    norm_before_fc: bool = entry("one RMSNorm (input_norm) over the two target layers' features together, "
                                 "before fc", default=False, block=True, null_absent=False, check=flag)
    fc_norm: bool = entry("one RMSNorm per target layer (fc_norm.{i}) before fc", default=False, block=True,
                          null_absent=False, check=flag)
    metadata: dict = entry("provenance, written by the converter into the vLLM layout", default_factory=dict,
                           read=lambda reading: {k: v for k, v in reading.own_block().items() if k in PROVENANCE})
    speculators: Speculators | None = entry("the vLLM layout's speculators block, where the converter knew the "
                                            "verifier", default=None,
                                            read=lambda reading: Speculators.from_config(reading.raw, reading.source))

    # ---------------------------------------------------------------- reading
    @classmethod
    def from_dict(cls, raw: Any, *, source: str = "config.json", layer_id_convention: str | None = None) -> EDSDConfig:
        """Validate a config.json dict of either layout.

        ``layer_id_convention`` overrides the convention recorded in the file (the
        converter's ``--layer-id-convention``); the result always holds vLLM ids.
        """
        cfg = super().from_dict(raw, source=source, layer_id_convention=layer_id_convention)
        refuse_both_fc_input_norms({name: getattr(cfg, name) for name in FC_INPUT_NORMS}, source,
                                   lambda name: f"edsd_config.{name}")
        if cfg.token_norm_folded and cfg.attention_reads_token:
            raise EDSDError(
                f"{source}: edsd_config has both token_norm_folded and attention_reads_token; "
                f"{FOLD_CONFLICT}, so no converter writes this pair: re-convert the training "
                "checkpoint without --fold-token-norm"
            )
        return cfg

    @classmethod
    def check_file(cls, raw: Any, source: str) -> None:
        """The ``edsd_config`` block makes a config.json an EDSD drafter's."""
        super().check_file(raw, source)
        if not isinstance(raw.get(cls.BLOCK), dict):
            raise EDSDError(
                f"{source}: no 'edsd_config' block; this is not an EDSD drafter "
                f"(architectures={raw.get('architectures')})"
            )

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
        """A drafter shaped for a target's ``config.json`` (``DraftConfig.target_layer_fields``;
        EDFuse as wide as the target's FFN; the token norm of SpecForge's EDSD unless asked
        otherwise). ``source`` names the target's file in errors."""
        t = text_config(target, source)
        fingerprint = TargetFingerprint.from_hf_config(t, source)
        raw = cls.target_layer_fields(t, fingerprint, draft_vocab_size=draft_vocab_size,
                                      intermediate_size=intermediate_size)
        raw[cls.BLOCK] = {
            "aux_layer_ids": list(aux_layer_ids),
            "aux_layer_id_convention": LAYER_INPUT,
            "fuse_intermediate_size": fuse_intermediate_size or t.get("intermediate_size"),
            "token_norm": token_norm,
            "token_norm_eps": t.get("rms_norm_eps", 1e-5),
            "target": {k: v for k, v in asdict(fingerprint).items() if v is not None},
        }
        cfg = cls.from_dict(raw, source=f"drafter config for {source}")
        cfg.check_target(fingerprint)
        return cfg

    # ---------------------------------------------------------------- writing
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
        block.update({name: True for name in SWITCHES if getattr(self, name)})  # the paper's design writes neither
        if self.target is not None:
            block["target"] = {k: v for k, v in asdict(self.target).items() if v is not None}
        block.update(self.metadata)
        return block

    def to_training_dict(self, architecture: str) -> dict:
        """config.json of the training layout (docs/formats.md), ids in vLLM's convention."""
        return {
            "architectures": [architecture],
            **self.llama_fields(),
            self.BLOCK: self._edsd_block(LAYER_INPUT),
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
            self.BLOCK: self._edsd_block(LAYER_INPUT),
        }
        if self.speculators is not None:
            out.update(self.speculators.to_dict(self.llama_fields()))
        return out

    # ---------------------------------------------------------------- checking
    @property
    def carries_embedding(self) -> bool:
        """A folded token norm lives in the drafter's own embedding table."""
        return self.token_norm_folded

    def layers_read(self) -> tuple[int, ...]:
        return self.aux_layer_ids
