"""The drafting methods' names and what the registry records of each (``Method``).

Every method is a folder of ``vllm_edsd/methods/`` that builds its ``Method`` in its
``__init__``, and one line of ``vllm_edsd/methods/__init__.py`` lists it. This module is the
only place a method's name is written: code elsewhere reads ``Method.name`` or the constants
below.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm_edsd.checkpoint.layouts import Layout
    from vllm_edsd.methods.blocks import DraftHead

EDSD = "edsd"
EAGLE3 = "eagle3"
VLLM_EAGLE3 = "eagle3"  # vLLM's speculative method for EAGLE-3 drafters; it serves EDSD's too


@dataclass(frozen=True)
class Method:
    """One drafting method: its reference model, its checkpoint layouts, how vLLM serves it and
    the defaults its training takes."""

    name: str  # the ``--method`` value, the speculative config's ``"method"``, a folder's name
    label: str  # how reports and tables name it
    model: type[DraftHead]  # the plain-PyTorch definition (training, conversion checks, parity)
    layouts: tuple[Layout, ...]  # every layout its drafters come in; the first is what training writes
    served_layout: Layout  # what the vLLM model class loads
    vllm_method: str  # the method vLLM drafts with
    vllm_model: str | None  # "module:Class" of the plugin's vLLM model; None where vLLM's own class serves it
    aux_layers: int  # how many target layers its ``fc`` reads
    # The aux layers from the target's layer count; None: EDSelect chooses them.
    default_layers: Callable[[int], list[int]] | None
    curriculum: bool  # EDTrain's Mask-p/Step-n curriculum on by default
    own_train_fields: tuple[str, ...] = ()  # ``edsd train`` flags of this method's architecture alone
    converts: bool = False  # its trained checkpoint is converted (``edsd convert``) before vLLM serves it
    # Its draft layer's on/off variants: ``edsd train`` flags, ``[train]`` keys and config.json keys of one name.
    switches: tuple[str, ...] = ()
    # Refuses a combination of its switches that makes no drafter, one line:
    # (name -> on, where they were given, how ``where`` spells a name) -> None; None: every combination is one.
    refuse_switches: Callable[[Mapping[str, Any], str, Callable[[str], str]], None] | None = None
