"""EAGLE-3's config.json (``Eagle3Config``): the draft layer every EAGLE-style drafter has
(``DraftConfig``) and the four switches of EAGLE 3.1, under the names speculators trains them
with and vLLM's ``Eagle3LlamaForCausalLM`` reads (``model_executor/models/llama_eagle3.py``):

- ``norm_before_fc``: one RMSNorm (``input_norm``) over the concatenated 3·d target features
  before ``fc``;
- ``fc_norm``: one RMSNorm per target layer (``fc_norm.{i}``) over its d-wide part, the
  per-layer alternative to ``norm_before_fc`` (so at most one of the two is on);
- ``norm_before_residual``: the decoder layer's residual is ``hidden_norm(h)``, not ``h``;
- ``norm_output``: the state fed back to the next draft step is the final norm's output, not
  its input.

All four off is the EAGLE-3 this project trained first, and what a file without them means,
except a speculators-format file: vLLM's speculators reader takes ``norm_before_residual`` on
where such a file leaves it out, so this reader does too.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from vllm_edsd.checkpoint.schema import Reading, entry
from vllm_edsd.methods.draft_config import FC_INPUT_NORMS, DraftConfig, flag, refuse_both_fc_input_norms
from vllm_edsd.methods.registry import VLLM_EAGLE3

SWITCHES = (*FC_INPUT_NORMS, "norm_before_residual", "norm_output")  # EAGLE 3.1's, speculators' names


def _norm_before_fc(reading: Reading) -> Any:
    """vLLM reads ``eagle_config.norm_before_fc`` first, then the top-level key."""
    eagle_config = reading.raw.get("eagle_config")
    eagle_config = eagle_config if isinstance(eagle_config, dict) else {}
    return eagle_config.get("norm_before_fc", reading.raw.get("norm_before_fc", False))


def _speculators_file(reading: Reading) -> bool:
    """Where a speculators-format EAGLE-3 file leaves ``norm_before_residual`` out, vLLM's
    speculators reader turns it on; a plain config means off."""
    return reading.raw.get("speculators_model_type") == VLLM_EAGLE3


@dataclass(frozen=True, kw_only=True)
class Eagle3Config(DraftConfig):
    """An EAGLE-3 drafter's draft layer and its EAGLE 3.1 switches, read after the draft layer's
    fields, at the top level of config.json (where vLLM reads them)."""

    norm_before_fc: bool = entry("one RMSNorm (input_norm) over the concatenated target features before fc",
                                 default=False, read=_norm_before_fc, check=flag)
    fc_norm: bool = entry("one RMSNorm per target layer (fc_norm.{i}) before fc", default=False,
                          null_absent=False, check=flag)
    norm_before_residual: bool = entry("the decoder layer's residual is hidden_norm(h), not h", default=False,
                                       absent=_speculators_file, null_absent=False, check=flag)
    norm_output: bool = entry("the state fed back to the next draft step is the final norm's output",
                              default=False, null_absent=False, check=flag)

    @classmethod
    def from_dict(cls, raw: Any, *, source: str = "config.json", **options: Any) -> Eagle3Config:
        """Validate a config.json dict, refusing both norms of fc's input at once."""
        cfg = super().from_dict(raw, source=source, **options)
        refuse_both_fc_input_norms(cfg.switches(), source)
        return cfg

    @classmethod
    def of(cls, cfg: DraftConfig, **switches: bool) -> Eagle3Config:
        """``cfg``'s draft layer (any method's config shaped for the target) with ``switches``
        on; an ``Eagle3Config`` keeps its own switches where ``switches`` does not name them."""
        own = cfg.switches() if isinstance(cfg, Eagle3Config) else {}
        shared = {f.name: getattr(cfg, f.name) for f in fields(DraftConfig)}
        return cls(**shared, **{**own, **switches})

    def switches(self) -> dict[str, bool]:
        """The EAGLE 3.1 switches, name -> on, as config.json writes them."""
        return {name: getattr(self, name) for name in SWITCHES}
