"""Building vLLM engines (and ``--vllm-args``, the engine arguments a command passes them) and
reading speculative-decoding counters, shared by the demo, the benchmarks and the tests.

Acceptance is read from vLLM's own metrics (``vllm:spec_decode_*``): mean acceptance
length τ = 1 + accepted / drafts, per-position rate = accepted at position i / drafts.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_edsd.checkpoint.target import context_length
from vllm_edsd.errors import EDSDError

CPU_MEMORY_FRACTION = float(os.environ.get("EDSD_CPU_MEMORY_FRACTION", "0.25"))
# vLLM's CPU worker sizes the KV cache as the fraction above of its NUMA node's memory, less
# what the worker already holds after warm-up; a VM whose node reports 9 GiB was left 0.32 GiB,
# less than one 8,192-token sequence of the demo target needs. Engines started here on a CPU
# hold at most this many tokens per sequence (docs/known-issues.md).
CPU_MAX_MODEL_LEN = 2048
# vLLM's exception when an engine core did not start: it only refers to the core's logged reason.
ENGINE_START_FAILED = "Engine core initialization failed"


def on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


# The CPU flags whose matrix instructions compute a 16-bit dtype natively; without them vLLM's
# CPU build converts to float32 around every product, several times slower than float32 itself.
NATIVE_CPU_FLAGS = {"bfloat16": ("avx512_bf16", "amx_bf16"), "float16": ("avx512_fp16", "amx_fp16")}


def cpu_flags() -> set[str]:
    """The words of ``/proc/cpuinfo`` (its flags among them); empty where it cannot be read."""
    try:
        return set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return set()


def cpu_computes_natively(dtype: str) -> bool:
    """Whether this CPU computes ``dtype`` natively: float32 always, a 16-bit dtype where
    ``/proc/cpuinfo`` lists one of its ``NATIVE_CPU_FLAGS``."""
    return dtype not in NATIVE_CPU_FLAGS or bool(cpu_flags() & set(NATIVE_CPU_FLAGS[dtype]))


def cpu_dtype() -> str:
    """bfloat16 where the CPU computes it natively (AVX-512 BF16 or AMX), else float32: on an
    AVX2-only CPU bf16 matrix products are emulated and several times slower than fp32."""
    return "bfloat16" if cpu_computes_natively("bfloat16") else "float32"


def engine_dtype(llm) -> str:
    """The dtype an ``LLM``'s model computes in (``float32``, ``bfloat16``...)."""
    return str(llm.llm_engine.model_config.dtype).removeprefix("torch.")


def cpu_instruction_set() -> str:
    """The CPU's widest matrix instructions, which decide bf16's speed and rounding here."""
    flags = cpu_flags()
    if not flags:
        return "unknown"
    found = [name for name in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if name in flags]
    return " ".join(found) or "none of amx_bf16, avx512_bf16, avx512f, avx2"


def use_cpu_workarounds() -> None:
    """Environment defaults for vLLM's CPU build, set before an engine (or server) starts.

    vLLM 0.32 on CPU cannot load its own ahead-of-time compiled artifacts ("Compiling model
    again due to a load failure ... 'function' object has no attribute 'finalize_loading'");
    the failed load can end the worker with a stack overflow in the oneDNN GEMM handler's
    finaliser (docs/known-issues.md; ``serving/repairs/cpu_onednn.py`` repairs the finaliser). Compiling
    without the AOT cache costs nothing, since the cached artifact is never usable. A value the
    user set is kept."""
    if on_cpu():
        os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")


def use_every_cpu_core() -> None:
    """For an offline batch job (regeneration, feature extraction), set before its engine
    starts: on CPU vLLM then computes on every core, where it would keep one for serving. A
    value the user set is kept."""
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")


def speculative_config(method: str, model: str | None, k: int, **extra: Any) -> dict | None:
    """The ``speculative_config`` dict for ``method`` in (none, eagle3, edsd, ...)."""
    if method == "none":
        return None
    return {"method": method, "model": model, "num_speculative_tokens": k, **extra}


def add_vllm_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--vllm-args", type=engine_arguments, default={},
                        help="JSON object of vLLM engine arguments for the target's engines (regeneration, "
                             "features), e.g. '{\"tensor_parallel_size\": 8}'")


def engine_arguments(text: str) -> dict:
    """``--vllm-args``: a JSON object, passed to ``LLM(...)`` as keyword arguments."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object of engine arguments")
    return value


def make_llm(target: str, spec: dict | None = None, **kwargs: Any):
    """An ``LLM`` with statistics enabled and CPU-friendly defaults (this machine's vLLM
    reads ``gpu_memory_utilization`` as a fraction of CPU memory)."""
    from vllm import LLM

    defaults: dict[str, Any] = {"disable_log_stats": False, "seed": 0}
    use_cpu_workarounds()
    if on_cpu():
        defaults.update(gpu_memory_utilization=CPU_MEMORY_FRACTION, max_model_len=cpu_max_model_len(target),
                        dtype=cpu_dtype())
    defaults.update(kwargs)
    try:
        return LLM(model=target, speculative_config=spec, **defaults)
    except RuntimeError as exc:  # the engine core's own error is in the log above, not in this one
        if ENGINE_START_FAILED not in str(exc):
            raise
        raise EDSDError(f"vLLM's engine failed to start; the engine core logged its reason above (its ERROR lines)"
                        f"{cpu_memory_settings()}") from None


def cpu_max_model_len(target: str) -> int:
    """The context a CPU engine gets unless asked otherwise: ``CPU_MAX_MODEL_LEN``, or the
    target's own where it is shorter (vLLM refuses a ``max_model_len`` past the target's). A
    model vLLM resolves itself (a hub id) is left at ``CPU_MAX_MODEL_LEN``."""
    if not Path(target, "config.json").is_file():
        return CPU_MAX_MODEL_LEN
    context = context_length(target)
    return CPU_MAX_MODEL_LEN if context is None else min(CPU_MAX_MODEL_LEN, context)


def cpu_memory_settings() -> str:
    """On a CPU, the memory settings engines and servers started here get, and how to change
    them: vLLM's advice for too little memory names a value the user did not set."""
    if not on_cpu():
        return ""
    return (f" (vllm-edsd starts CPU engines with gpu_memory_utilization {CPU_MEMORY_FRACTION} and at most "
            f"{CPU_MAX_MODEL_LEN} tokens of context; the environment variable EDSD_CPU_MEMORY_FRACTION sets "
            "another fraction)")


@contextmanager
def llm_session(target: str, spec: dict | None = None, **kwargs: Any) -> Iterator[Any]:
    """``make_llm`` that shuts its engine down on exit, so the next engine has the memory."""
    import gc

    llm = make_llm(target, spec, **kwargs)
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


@dataclass
class SpecCounters:
    """Cumulative ``vllm:spec_decode_*`` counters of one engine."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def __sub__(self, other: SpecCounters) -> SpecCounters:
        per_pos = [a - (other.accepted_per_pos[i] if i < len(other.accepted_per_pos) else 0)
                   for i, a in enumerate(self.accepted_per_pos)]
        return SpecCounters(self.drafts - other.drafts, self.draft_tokens - other.draft_tokens,
                            self.accepted - other.accepted, per_pos)

    @property
    def mean_acceptance_length(self) -> float | None:
        return None if self.drafts == 0 else 1.0 + self.accepted / self.drafts

    @property
    def mean_draft_length(self) -> float | None:
        """Draft tokens per drafted step: K, unless the draft length adapts (or vLLM trims)."""
        return None if self.drafts == 0 else self.draft_tokens / self.drafts

    @property
    def acceptance_per_position(self) -> list[float]:
        return [a / self.drafts for a in self.accepted_per_pos] if self.drafts else []

    def as_dict(self) -> dict:
        return {
            "drafts": self.drafts,
            "draft_tokens": self.draft_tokens,
            "accepted": self.accepted,
            "accepted_per_pos": list(self.accepted_per_pos),
            "tau": self.mean_acceptance_length,
            "acceptance_per_pos": self.acceptance_per_position,
        }


def spec_counters(llm) -> SpecCounters:
    """Read the counters of an ``LLM`` built with ``disable_log_stats=False``."""
    counters = SpecCounters()
    for metric in llm.get_metrics():
        if metric.name == "vllm:spec_decode_num_drafts":
            counters.drafts += int(metric.value)
        elif metric.name == "vllm:spec_decode_num_draft_tokens":
            counters.draft_tokens += int(metric.value)
        elif metric.name == "vllm:spec_decode_num_accepted_tokens":
            counters.accepted += int(metric.value)
        elif metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            values = [int(v) for v in metric.values]
            if not counters.accepted_per_pos:
                counters.accepted_per_pos = [0] * len(values)
            counters.accepted_per_pos = [a + b for a, b in zip(counters.accepted_per_pos, values)]
    return counters


def parse_prometheus_counters(text: str) -> SpecCounters:
    """The same counters from a ``/metrics`` page of the OpenAI-compatible server."""
    counters = SpecCounters()
    per_pos: dict[int, int] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:spec_decode_") or " " not in line:
            continue
        name_labels, value = line.rsplit(" ", 1)
        name = name_labels.split("{", 1)[0]
        number = int(float(value))
        if name == "vllm:spec_decode_num_drafts_total":
            counters.drafts += number
        elif name == "vllm:spec_decode_num_draft_tokens_total":
            counters.draft_tokens += number
        elif name == "vllm:spec_decode_num_accepted_tokens_total":
            counters.accepted += number
        elif name == "vllm:spec_decode_num_accepted_tokens_per_pos_total":
            pos = int(name_labels.split('position="', 1)[1].split('"', 1)[0])
            per_pos[pos] = per_pos.get(pos, 0) + number
    counters.accepted_per_pos = [per_pos[i] for i in sorted(per_pos)]
    return counters
