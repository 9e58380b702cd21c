"""Every vLLM name vllm-edsd depends on, with the shape it expects: one table, read by
``scripts/check_vllm_range.py`` against the source of every supported vLLM release.

The plugin imports vLLM lazily and wraps what it replaces with ``*args, **kwargs`` where it
can, so a name vLLM moves or reshapes shows up only when an engine reaches it. This table
says, per name, what the plugin needs, so that a release can be checked by reading its source
(``ast``), without a GPU and without importing it.

Every row of ``patches.PATCHES`` and ``patches.REFUSAL`` is checked, as its kind calls for
(``expected``): a row names its owner and attribute, and ``PATCHED`` records only what a row
cannot say (the signature a replacement, a hook or an override expects, the class vLLM
instantiates, a config attribute's counterpart in vLLM); the kinds a row describes fully
(a private attribute, an environment variable, an exception) are checked from the row
alone. A row of another kind without an entry has no check, and tests/unit/test_serving_vllm_range.py
fails. ``READ`` holds what the plugin reads, calls or subclasses without changing it: a name
that is a row is not listed again there.

``signature`` is a callable's parameters as the plugin uses them, comma-separated: the
leading names in order, then ``...`` where any further parameters may follow, and after it
names that may stand anywhere (passed by keyword). Without ``...`` the list is exact (the
plugin replaces the whole callable, so every parameter must match). A class's signature is its
``__init__``'s, the fields of a ``@dataclass``/``@config`` class included.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_edsd.methods import EDSD_METHOD
from vllm_edsd.serving.features.draft_length import CONFIG_ATTRIBUTE, LIMITER_ATTRIBUTE
from vllm_edsd.serving.features.lookup import CONFIG_ATTRIBUTE as LOOKUP_ATTRIBUTE
from vllm_edsd.serving.features.lookup import VLLM_KEYS as LOOKUP_KEYS
from vllm_edsd.serving.features.lookup import WORKER_METHOD
from vllm_edsd.serving.patching import ENVIRONMENT, EXCEPTION, PRIVATE, Patch, source_path


@dataclass(frozen=True)
class VllmName:
    """``owner.name`` in vLLM, as the plugin uses it.

    ``owner`` is ``"module"`` or ``"module:Name"`` (a class; or a module-level dict or
    ``Literal`` alias, whose keys or members are then what ``name`` names). ``name`` is an
    attribute, method, field or member of it; ``""`` for the owner itself. ``kind="text"``: a
    string the module's code holds, or begins one with (a metric name, an error message the
    plugin matches; docstrings do not count). ``absent``: the name must *not* be there
    (a method name vLLM must not claim). ``optional``: what the plugin does where the name is
    missing; such a name is no break. ``applies_if``: ``"module:Class.attribute"`` that must
    exist in a release for this entry to apply there (``"!..."``: must not). ``sets``: the
    attributes the plugin's subclass sets instead of calling this ``__init__``; vLLM's own
    ``__init__`` must set no other. ``reaches``: subclasses (``"module:Class"``) vLLM uses in
    place of the owner, which a replacement of ``name`` on the owner must reach: they inherit
    it, or their own calls it through ``super()``. ``used_as``: subclasses vLLM instantiates,
    where ``name`` is checked too (a hook set on an instance meets the method of the instance's
    class). ``set_by``: ``"module:Class.method"`` of vLLM that assigns an attribute ``name`` too
    (a config attribute the plugin sets as vLLM's own code does). ``not_checked``: why vLLM's
    source has nothing to check (the plugin's own attribute); the row is n/a everywhere."""

    owner: str
    name: str
    used_by: str
    signature: str | None = None
    kind: str = "name"
    absent: bool = False
    optional: str = ""
    applies_if: str = ""
    sets: tuple[str, ...] = ()
    reaches: tuple[str, ...] = ()
    used_as: tuple[str, ...] = ()
    set_by: str = ""
    not_checked: str = ""

    @property
    def label(self) -> str:
        """A short name for tables: ``Class.attribute``, ``module.function``, ``module 'text'``."""
        module, _, inner = self.owner.partition(":")
        head = inner or module.rsplit(".", 1)[-1]
        if self.kind == "text":
            return f"{head} {self.name!r}"
        if not self.name:
            return inner or module
        return f"{head}.{self.name}"


# Where each name is used: paths relative to vllm_edsd/.
_PLUGIN = "serving/plugin.py"  # the registrations
_REQUEST = "serving/request.py"  # the speculative config's check and translation
_HOOKS = "serving/hooks.py"  # the engine, runner and proposer hooks
_USER_ERRORS = "serving/user_errors.py"
_LIMITER = "serving/features/draft_length.py"
_LOOKUP = "serving/features/lookup.py"
_CPU_SAMPLING = "serving/repairs/cpu_sampling.py"
_CPU_ONEDNN = "serving/repairs/cpu_onednn.py"
_CPU_NOISE = "serving/repairs/cpu_noise.py"
_MODEL = source_path(EDSD_METHOD.vllm_model).partition(":")[0].removeprefix("vllm_edsd/")
_CONNECTOR = "features/host_connector.py"
_FEATURES = "features/vllm_extraction.py"
_CPU_KERNELS = "vllm.platforms.cpu:CpuPlatform.register_triton_kernel_overrides"

_PROPOSER = "vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer"
_DRAFT_VOCAB = "serving/draft_vocab.py"
_EAGLE_PROPOSER = "vllm.v1.spec_decode.eagle:EagleProposer"  # the proposer of "eagle3", so of "edsd"
_EXTRACTION = "without it, edsd features/train use transformers for the target's hidden states"
_CONNECTOR_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector"
_CONNECTOR_CLASS = _CONNECTOR_MODULE + ":ExampleHiddenStatesConnector"
_EAGLE3 = "vllm.model_executor.models.llama_eagle3:Eagle3LlamaForCausalLM"
_DRAFTER_CONFIG = "vllm.config:ModelConfig.hf_config"

# What a row of patches.PATCHES (or patches.REFUSAL) cannot say itself, by its owner and
# attribute: one entry serves every row of that name (the replacement of
# SpeculativeConfig.__init__, the refusal, and the exception raised through it).
PATCHED: tuple[VllmName, ...] = (
    VllmName("vllm.config:SpeculativeConfig", "__init__", _REQUEST,
             "self, ..., method, model, num_speculative_tokens, draft_sample_method"),
    VllmName("vllm.engine.arg_utils:EngineArgs", "create_engine_config", _HOOKS, "self, ...",
             reaches=("vllm.engine.arg_utils:AsyncEngineArgs",)),
    VllmName(_PROPOSER, "load_model", _HOOKS, "self, ...", reaches=(_EAGLE_PROPOSER,)),
    VllmName("vllm.v1.worker.gpu_model_runner:GPUModelRunner", "propose_draft_token_ids", _HOOKS, "self, ...",
             reaches=("vllm.v1.worker.cpu_model_runner:CPUModelRunner",)),
    VllmName("vllm.v1.engine.input_processor:InputProcessor", "_validate_params", _HOOKS, "self, params, ..."),
    VllmName("vllm.v1.engine.core:EngineCore", "preprocess_add_request", _HOOKS, "self, request"),
    VllmName("vllm.platforms.cpu:CpuPlatform", "register_triton_kernel_overrides", _CPU_SAMPLING, "cls",
             applies_if=_CPU_KERNELS),
    VllmName("vllm.v1.worker.cpu_model_runner:CPUModelRunner", "_postprocess_triton", _CPU_SAMPLING, "self",
             applies_if="!" + _CPU_KERNELS),
    VllmName("vllm.v1.sample.rejection_sampler", "expand_batch_to_tokens", _CPU_SAMPLING,
             "x, cu_num_tokens, num_tokens, replace_from, replace_to"),
    VllmName("vllm._custom_ops:CPUDNNLGEMMHandler", "__del__", _CPU_ONEDNN, "self"),
    VllmName("vllm.v1.sample.rejection_sampler", "sample_recovered_tokens", _CPU_NOISE,
             "max_spec_len, num_draft_tokens, cu_num_draft_tokens, draft_token_ids, draft_probs, target_probs, "
             "sampling_metadata, device, use_fp64_gumbel"),
    VllmName("vllm.v1.spec_decode.llm_base_proposer", "compute_probs_and_sample_next_token", _CPU_NOISE,
             "logits, sampling_metadata, use_fp64_gumbel"),
    # instance hooks: the hook passes propose's arguments on, and vLLM's loop calls the sampling
    # hook as it calls its own method; the limiter's attribute must be no name of vLLM's
    VllmName(_PROPOSER, "propose", _LIMITER, "self, ...", used_as=(_EAGLE_PROPOSER,)),
    VllmName(_PROPOSER, "_sample_draft_tokens", _LIMITER, "self, hidden_states, sampling_metadata",
             used_as=(_EAGLE_PROPOSER,)),
    VllmName(_PROPOSER, LIMITER_ATTRIBUTE, _LIMITER, absent=True, used_as=(_EAGLE_PROPOSER,)),
    # the override: vLLM's connector calls it as it calls its own
    VllmName(_CONNECTOR_CLASS, "_submit_async_write", _CONNECTOR, "self, pending", optional=_EXTRACTION),
    # config attributes on the drafter's hf_config
    VllmName(_DRAFTER_CONFIG, CONFIG_ATTRIBUTE, _REQUEST,
             not_checked="our own attribute: it carries the plugin's settings to its own model class, and no "
                         "vLLM code reads it"),
    VllmName(_DRAFTER_CONFIG, LOOKUP_ATTRIBUTE, _LOOKUP,
             not_checked="our own attribute: it carries num_drafter_tokens to the plugin's runner hook, and no "
                         "vLLM code reads it"),
    VllmName(_DRAFTER_CONFIG, "draft_vocab_size", _MODEL, set_by=_EAGLE3 + ".__init__"),
    # vLLM's own n-gram fields, which the lookup puts back on the config
    *(VllmName("vllm.config:SpeculativeConfig", key, _LOOKUP) for key in LOOKUP_KEYS),
    VllmName(_DRAFTER_CONFIG, "target_layer_count", _MODEL, set_by=_EAGLE3 + ".__init__"),
    # the worker method collective_rpc calls by name: no name of vLLM's
    VllmName("vllm.v1.worker.worker_base:WorkerBase", WORKER_METHOD, _LOOKUP, absent=True),
)

# Owners the plugin can go without: a row on them that a release lacks is no break.
WITHOUT: dict[str, str] = {_CONNECTOR_CLASS: _EXTRACTION}


def expected(patch: Patch) -> VllmName | None:
    """What the range check reads for ``patch``: its entry in ``PATCHED``, else, for a kind the
    row describes fully, the row's own owner and attribute (a private attribute is assigned or
    defined in the owner or a vLLM base class; an environment variable is one vLLM's
    ``envs.environment_variables`` reads; an exception's method exists). None: the row has no
    check (a replacement, hook or override needs the signature it expects recorded)."""
    recorded = {(e.owner, e.name): e for e in PATCHED}.get((patch.owner, patch.attribute))
    if recorded is not None:
        return recorded
    used_by = ", ".join(place.removeprefix("vllm_edsd/") for place in patch.where)
    if patch.kind == ENVIRONMENT:
        return VllmName(f"{patch.owner}:environment_variables", patch.attribute, used_by)
    if patch.kind in (PRIVATE, EXCEPTION):
        return VllmName(patch.owner, patch.attribute, used_by, optional=WITHOUT.get(patch.owner, ""))
    return None


EAGLE3_ATTRIBUTES = ("config", "draft_id_to_target_id", "lm_head", "logits_processor", "model",
                      "use_parallel_drafting")
_LINEAR = "self, input_size, output_size, ..., bias, quant_config, prefix, return_bias"
_ENGINE = "launch/engine.py"


def _of(owner: str, used_by: str, *names: str | tuple[str, str], **flags: Any) -> tuple[VllmName, ...]:
    """Entries for several names of one owner; a name with its signature is ``(name, signature)``."""
    entries = []
    for item in names:
        name, signature = (item, None) if isinstance(item, str) else item
        entries.append(VllmName(owner, name, used_by, signature, **flags))
    return tuple(entries)


# What the plugin reads, calls or subclasses without replacing it.
READ: tuple[VllmName, ...] = (
    # the method alias, the speculators format, the model registry, the front end
    *_of("vllm.config.speculative:SpeculativeMethod", _REQUEST, EDSD_METHOD.vllm_method),
    VllmName("vllm.config.speculative:SpeculativeMethod", EDSD_METHOD.name, _REQUEST, absent=True),
    *_of("vllm.config.speculative:SpeculativeConfig", _REQUEST, "draft_model_config", "target_model_config",
         "parallel_drafting", "num_speculative_tokens"),
    *_of("vllm.config.model:ModelConfig", _REQUEST, "hf_config", "hf_text_config", "architectures",
         ("get_total_num_hidden_layers", "self")),
    VllmName("vllm.transformers_utils.configs.speculators.algos", "register_speculator", _PLUGIN, "name",
             optional="without it, a drafter directory cannot be served alone (vllm serve DRAFTER_DIR)"),
    *_of("vllm.transformers_utils.configs.speculators.algos", _PLUGIN, EDSD_METHOD.name, kind="text", absent=True),
    *_of("vllm.model_executor.models.registry", _PLUGIN, *EDSD_METHOD.served_layout.architectures, kind="text",
         absent=True),
    *_of("vllm.model_executor.models.registry:_ModelRegistry", _PLUGIN,
         ("register_model", "self, model_arch, model_cls")),
    *_of("vllm", _PLUGIN, "ModelRegistry"),
    *_of("vllm.exceptions:VLLMValidationError", _HOOKS, ("", "self, message, ..., parameter, value")),
    *_of("vllm._custom_ops:CPUDNNLGEMMHandler", _CPU_ONEDNN, "handler_tensor"),
    *_of("vllm.v1.sample.sampler", _CPU_NOISE, "_SAMPLING_EPS"),
    *_of("vllm.v1.sample.metadata:SamplingMetadata", _CPU_NOISE, "temperature", "all_greedy", "all_random",
         "generators"),
    *_of("vllm.entrypoints.openai.api_server", "launch/server.py", ""),
    *_of("vllm.entrypoints.cli.main", _USER_ERRORS, ""),
    # engine configuration the plugin sets or checks
    *_of("vllm.engine.arg_utils:EngineArgs", "launch/server.py", "model", "speculative_config", "dtype",
         "max_model_len", "gpu_memory_utilization"),
    *_of("vllm.engine.arg_utils:EngineArgs", _LIMITER, "async_scheduling"),
    *_of("vllm.config.vllm:VllmConfig", _HOOKS, "speculative_config", "scheduler_config", "parallel_config"),
    VllmName("vllm.config.vllm:VllmConfig", "use_v2_model_runner", _LIMITER,
             optional="read with getattr: where absent, vLLM has the V1 runner only"),
    *_of("vllm.config.scheduler:SchedulerConfig", _LIMITER, "async_scheduling"),
    *_of("vllm.config.parallel:ParallelConfig", _HOOKS, "data_parallel_size"),
    *_of("vllm.envs:environment_variables", _LIMITER, "VLLM_USE_V2_MODEL_RUNNER"),
    # the runner and the proposer the draft-length limiter works with
    *_of("vllm.v1.worker.gpu_model_runner:GPUModelRunner", _HOOKS, "input_batch", "requests",
         "speculative_config", "drafter"),
    *_of("vllm.v1.worker.gpu_input_batch:InputBatch", _HOOKS, "req_ids"),
    *_of("vllm.v1.worker.gpu_input_batch:CachedRequestState", _LIMITER, "sampling_params"),
    *_of("vllm.sampling_params:SamplingParams", _LIMITER, "extra_args"),
    *_of("vllm.v1.engine.input_processor:InputProcessor", _HOOKS, "vllm_config"),
    *_of("vllm.v1.engine.core:EngineCore", _HOOKS, "vllm_config"),
    *_of("vllm.v1.engine:EngineCoreRequest", _HOOKS, "sampling_params", "cache_salt"),
    *_of(_PROPOSER, _LIMITER, "model", "vllm_config"),
    VllmName(_PROPOSER, "use_local_argmax_reduction", _HOOKS,
             optional="read with getattr: where absent, the drafter's logits are always whole"),
    VllmName(_PROPOSER, "use_heterogeneous_vocab", _DRAFT_VOCAB,
             optional="read with getattr: where absent, vLLM has no heterogeneous vocabularies"),
    *_of(_EAGLE3, _DRAFT_VOCAB, "draft_id_to_target_id", "lm_head", "logits_processor"),
    *_of("vllm.platforms:current_platform", _ENGINE, ""),
    *_of("vllm.platforms.interface:Platform", _ENGINE, ("is_cpu", "self")),
    # the draft model: a subclass of vLLM's EAGLE-3 Llama drafter, built from vLLM's layers
    VllmName(_EAGLE3, "__init__", _MODEL, "self, ..., vllm_config, prefix", sets=EAGLE3_ATTRIBUTES),
    *_of(_EAGLE3, _MODEL, ("forward", "self, input_ids, positions, hidden_states, inputs_embeds"),
         ("compute_logits", "self, hidden_states"), ("combine_hidden_states", "self, hidden_states"),
         ("load_weights", "self, weights"), ("embed_input_ids", "self, input_ids, ...")),
    *_of("vllm.model_executor.models.llama:LlamaDecoderLayer", _MODEL, ("", "self, vllm_config, ..., prefix, config"),
         ("forward", "self, positions, hidden_states, residual, ..."), ("get_quant_config", "self, vllm_config"),
         "self_attn", "mlp", "input_layernorm", "post_attention_layernorm"),
    # a float16 drafter's float32 stream calls the layer's parts itself (methods/edsd/float16_range.py)
    *_of("vllm.model_executor.models.llama:LlamaAttention", _MODEL, ("forward", "self, positions, hidden_states")),
    *_of("vllm.model_executor.models.llama:LlamaMLP", _MODEL, ("forward", "self, x")),
    *_of("vllm.distributed.communication_op", _MODEL, ("tensor_model_parallel_all_reduce", "input_")),
    *_of("vllm.distributed.parallel_state", _MODEL, ("get_tensor_model_parallel_world_size", "")),
    *_of("vllm.compilation.decorators", _MODEL, ("support_torch_compile", "..., dynamic_arg_dims")),
    *_of("vllm.config", _MODEL, "VllmConfig", "get_current_vllm_config"),
    *_of("vllm.model_executor.layers.layernorm:RMSNorm", _MODEL, ("", "self, hidden_size, ..., eps"), "weight",
         "variance_epsilon"),
    *_of("vllm.model_executor.layers.linear:ColumnParallelLinear", _MODEL, ("", _LINEAR)),
    *_of("vllm.model_executor.layers.linear:RowParallelLinear", _MODEL, ("", _LINEAR + ", reduce_results")),
    *_of("vllm.model_executor.layers.linear:ReplicatedLinear", _MODEL, ("", _LINEAR + ", params_dtype")),
    # the draft layer whose attention also reads the token: a 2d-wide fused q/k/v projection
    *_of("vllm.model_executor.layers.linear:QKVParallelLinear", _MODEL,
         ("", "self, hidden_size, head_size, total_num_heads, total_num_kv_heads, bias, ..., quant_config, prefix")),
    *_of("vllm.model_executor.layers.logits_processor:LogitsProcessor", _MODEL, ("", "self, vocab_size, ...")),
    VllmName("vllm.model_executor.layers.logits_processor:LogitsProcessor", "get_top_tokens", _MODEL,
             "self, lm_head, hidden_states, ...",
             optional="called only under use_local_argmax_reduction, which a vLLM without it lacks too"),
    *_of("vllm.model_executor.layers.quantization.base_config", _MODEL, "QuantizationConfig"),
    *_of("vllm.model_executor.layers.vocab_parallel_embedding:VocabParallelEmbedding", _MODEL,
         ("", "self, num_embeddings, embedding_dim, ..., prefix")),
    *_of("vllm.model_executor.layers.vocab_parallel_embedding:ParallelLMHead", _MODEL,
         ("", "self, num_embeddings, embedding_dim, ..., quant_config, prefix")),
    *_of("vllm.model_executor.model_loader.weight_utils", _MODEL, ("default_weight_loader", "param, loaded_weight"),
         ("maybe_remap_kv_scale_name", "name, params_dict")),
    *_of("vllm.model_executor.models.utils:WeightsMapper", _MODEL, ("", "self, ..., orig_to_new_prefix"),
         ("apply_list", "self, values")),
    *_of("vllm.model_executor.models.utils", _MODEL, ("get_draft_quant_config", "vllm_config"),
         ("maybe_prefix", "prefix, name"), ("process_eagle_weight", "model, name")),
    # engines, prompts and counters (launch/, demo/, training/)
    *_of("vllm", _ENGINE, "LLM", "SamplingParams"),
    *_of("vllm.inputs", "demo/__init__.py", "TokensPrompt"),
    *_of("vllm.entrypoints.llm:LLM", _ENGINE, "llm_engine", ("get_metrics", "self")),
    *_of("vllm.v1.engine.llm_engine:LLMEngine", _ENGINE, "engine_core", "model_config"),
    *_of("vllm.v1.engine.core_client:EngineCoreClient", _ENGINE, ("shutdown", "self, ...")),
    *_of("vllm.v1.engine.utils", _ENGINE, "Engine core initialization failed", kind="text"),
    *_of("vllm.v1.spec_decode.metrics", _ENGINE, "vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
         "vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens_per_pos", kind="text"),
    # target features through vLLM's hidden-state extraction and its example connector
    *_of("vllm.config.speculative:SpeculativeMethod", _FEATURES, "extract_hidden_states", optional=_EXTRACTION),
    *_of("vllm.v1.spec_decode.extract_hidden_states", _FEATURES, "", optional=_EXTRACTION),
    *_of("vllm.config.kv_transfer:KVTransferConfig", _FEATURES, "kv_connector_module_path",
         "kv_connector_extra_config"),
    *_of("vllm.outputs:RequestOutput", _FEATURES, "kv_transfer_params"),
    *_of(_CONNECTOR_MODULE, _FEATURES, ("load_hidden_states", "path"), ("cleanup_hidden_states", "path, ..."),
         ("extract_from_kv_cache", "kv_cache, slot_mapping, num_tokens"), optional=_EXTRACTION),
    *_of(_CONNECTOR_MODULE + ":PendingSave", _CONNECTOR, ("", "self, ..., req_id, filename, token_ids, block_ids"),
         optional=_EXTRACTION),
)
