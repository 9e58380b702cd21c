"""The EAGLE-3 baseline, trained the same way as EDSD: its attention reads [token; feature]
(``model.py``, built from ``methods/blocks.py``); its drafters are written in the layout vLLM's
own EAGLE-3 method loads (``layouts.py``); EAGLE 3.1's switches of its norms (``config.py``)."""

from vllm_edsd.methods.draft_config import refuse_both_fc_input_norms
from vllm_edsd.methods.eagle3.config import SWITCHES
from vllm_edsd.methods.eagle3.layouts import EAGLE3_LAYOUT
from vllm_edsd.methods.eagle3.model import Eagle3DraftModel
from vllm_edsd.methods.registry import EAGLE3, VLLM_EAGLE3, Method


def default_layers(num_layers: int) -> list[int]:
    """vLLM's default aux layers for EAGLE-3: early, middle, late."""
    return [2, num_layers // 2, num_layers - 3]


METHOD = Method(
    name=EAGLE3,
    label="EAGLE-3",
    model=Eagle3DraftModel,
    layouts=(EAGLE3_LAYOUT,),
    served_layout=EAGLE3_LAYOUT,
    vllm_method=VLLM_EAGLE3,
    vllm_model=None,
    aux_layers=3,
    default_layers=default_layers,
    curriculum=False,
    own_train_fields=SWITCHES,
    switches=SWITCHES,
    refuse_switches=refuse_both_fc_input_norms,
)
