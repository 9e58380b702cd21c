"""Target features through vLLM's own hidden-state extraction (docs/scale.md, "Features").

vLLM's speculative method ``extract_hidden_states`` caches the residual stream of the chosen
layers for every prompt token, and its hidden-states KV connector writes each request's to a
safetensors file (``host_connector.py`` makes that connector work on vLLM's CPU build). The
target then runs with vLLM's batching, kernels and tensor parallelism instead of
transformers. The lm_head input is the target's own final norm of the last layer's output
(vLLM's aux id N), and the argmax and entropy come from the target's own lm_head, both read
alone from the target's checkpoint.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

from vllm_edsd.checkpoint.files import read_tensor, tensor_files
from vllm_edsd.checkpoint.target import decoder_layers
from vllm_edsd.errors import EDSDError

from .hidden_states import SampleFeatures, decoder_of, token_entropy

CONNECTOR = "HostHiddenStatesConnector"
LOGIT_CHUNK = 512  # positions per full-vocabulary product: bounds memory on large vocabularies


def unavailable_reason() -> str | None:
    """Why the installed vLLM cannot extract hidden states, or None where it can."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        return "vLLM is not installed"
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1 import example_hidden_states_connector  # noqa: F401
        from vllm.v1.spec_decode import extract_hidden_states  # noqa: F401
    except ImportError:
        import vllm

        return f"vLLM {vllm.__version__} has no hidden-state extraction (extract_hidden_states)"
    return None


def output_head(target: str | Path) -> tuple[torch.nn.Module, torch.Tensor]:
    """The target's final norm (its own module class) and lm_head weight, in float32, read from
    its checkpoint without loading the rest of the model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(target), local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    names = {module: name for name, module in model.named_modules()}
    files = tensor_files(target)

    def load(name: str) -> torch.Tensor:
        if name not in files:
            raise EDSDError(f"{target}: the checkpoint has no tensor '{name}' ({type(model).__name__})")
        return read_tensor(files[name], name).float()

    norm = decoder_of(model).norm.to_empty(device="cpu")
    norm.load_state_dict({key: load(f"{names[norm]}.{key}") for key in norm.state_dict()})
    head = names[model.get_output_embeddings()] + ".weight"
    if head not in files:  # tied embeddings
        head = names[model.get_input_embeddings()] + ".weight"
    return norm.float().eval(), load(head)


class VLLMFeatures:
    """Target features from a vLLM engine, started on first use and shut down on exit.

    ``engine_args`` go to ``LLM(...)`` (``tensor_parallel_size``, ``gpu_memory_utilization``...).
    The final norm, the lm_head product and the entropy run on ``device`` (the GPU where there
    is one: over a large vocabulary they cost as much as the target's forward).
    """

    backend = "vllm"

    def __init__(self, target: str | Path, layer_ids: tuple[int, ...], *, dtype: str, max_length: int,
                 device: str = "cpu", **engine_args):
        self.target, self.layer_ids, self.dtype, self.device = str(target), tuple(sorted(layer_ids)), dtype, device
        self.max_length, self.engine_args = max_length, engine_args
        self.llm, self.scratch, self.norm, self.head = None, None, None, None

    def __enter__(self) -> VLLMFeatures:
        return self

    def __exit__(self, *exc) -> None:
        if self.llm is not None:
            self.llm.llm_engine.engine_core.shutdown()
            self.llm = None
        if self.scratch is not None:
            self.scratch.cleanup()

    def _start(self) -> None:
        from vllm_edsd.launch.engine import make_llm, use_every_cpu_core

        norm, head = output_head(self.target)
        self.norm, self.head = norm.to(self.device), head.to(self.device)
        last = decoder_layers(self.target)
        self.captured = tuple(sorted({*self.layer_ids, last}))
        self.scratch = tempfile.TemporaryDirectory(prefix="edsd-hidden-states-")
        use_every_cpu_core()
        spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(self.captured)}}}
        transfer = {"kv_connector": CONNECTOR, "kv_connector_module_path": "vllm_edsd.features.host_connector",
                    "kv_role": "kv_producer", "kv_connector_extra_config": {"shared_storage_path": self.scratch.name}}
        self.llm = make_llm(self.target, spec, kv_transfer_config=transfer, dtype=self.dtype,
                            max_model_len=self.max_length + 1, enable_prefix_caching=False, **self.engine_args)

    def features(self, samples: Sequence[list[int]]) -> list[SampleFeatures]:
        """One ``SampleFeatures`` per token list, in order (one batched ``generate``)."""
        from vllm import SamplingParams
        from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
            cleanup_hidden_states,
            load_hidden_states,
        )

        if self.llm is None:
            self._start()
        outputs = self.llm.generate([{"prompt_token_ids": list(tokens)} for tokens in samples],
                                    SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
        found = []
        for tokens, output in zip(samples, outputs):
            path = (output.kv_transfer_params or {}).get("hidden_states_path")
            if path is None:
                raise EDSDError("vLLM returned no hidden states (its hidden-states connector did not run)")
            saved = load_hidden_states(path)
            cleanup_hidden_states(path)
            if saved["token_ids"].tolist() != list(tokens):
                raise EDSDError("vLLM's hidden states belong to other tokens than the sample's")
            found.append(self._sample(saved["hidden_states"]))
        return found

    def _sample(self, hidden: torch.Tensor) -> SampleFeatures:
        """``hidden`` [n, captured layers, d] (ascending ids) → what training keeps."""
        aux = hidden[:, [self.captured.index(i) for i in self.layer_ids]].flatten(1)
        with torch.no_grad():
            final = self.norm(hidden[:, -1].to(self.device, torch.float32))
            argmax, entropy = [], []
            for chunk in final.split(LOGIT_CHUNK):
                logits = chunk @ self.head.T
                argmax.append(logits.argmax(-1))
                entropy.append(token_entropy(logits))
        return SampleFeatures(aux, final, torch.cat(argmax), torch.cat(entropy))

