"""EDSD (Entropy-Driven Speculative Decoding): EDFuse fuses the target feature with the token,
one Llama decoder layer drafts (``model.py``); its layouts (``layouts.py``); its vLLM model
(``vllm_model.py``), served through vLLM's EAGLE-3 proposer; float16's range
(``float16_range.py``, ``range_probe.py``)."""

from vllm_edsd.methods.draft_config import refuse_both_fc_input_norms
from vllm_edsd.methods.edsd.config import SWITCHES
from vllm_edsd.methods.edsd.layouts import EDSD_VLLM, LAYOUTS
from vllm_edsd.methods.edsd.model import EDSDDraftModel
from vllm_edsd.methods.registry import EDSD, VLLM_EAGLE3, Method

METHOD = Method(
    name=EDSD,
    label="EDSD",
    model=EDSDDraftModel,
    layouts=LAYOUTS,
    served_layout=EDSD_VLLM,
    vllm_method=VLLM_EAGLE3,
    vllm_model="vllm_edsd.methods.edsd.vllm_model:EDSDLlamaForCausalLM",
    aux_layers=2,
    default_layers=None,
    curriculum=True,
    own_train_fields=("token_norm", "fuse_intermediate_size", *SWITCHES),
    converts=True,
    switches=SWITCHES,
    refuse_switches=refuse_both_fc_input_norms,
)
