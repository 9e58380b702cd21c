"""EDSelect's memory at a width where one layer's statistics dwarf the allocator's noise: each
measurement is a fresh process scoring the layers of a random hidden-1024 Llama."""

from __future__ import annotations

import os
import subprocess
import sys

from vllm_edsd.selection.scoring import TOKENS_FOR_ENTROPY

WIDTH = 1024
ONE_LAYER = 2 * WIDTH * WIDTH * 8 + TOKENS_FOR_ENTROPY * WIDTH * 4  # bytes: two D×D float64 and the token sample
# Measured (AVX2 EPYC): 4 samples 90 MiB, 24 samples 99, 6 layers 91, and 6 layers held at once
# (a budget of ten layers) 169. A covariance kept per sample would add 8 MiB × 20.
BOUND_MIB = 24
PEAK_MEMORY_SCRIPT = """
import resource, sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
from vllm_edsd.selection.scoring import score_layers

width, samples, layers, budget = (int(a) for a in sys.argv[1:5])
torch.manual_seed(0)
config = LlamaConfig(hidden_size=width, intermediate_size=512, num_hidden_layers=layers, num_attention_heads=16,
                     num_key_value_heads=4, vocab_size=256, max_position_embeddings=256)
model = LlamaForCausalLM(config).eval()
sequences = [torch.randint(0, 256, (48,)).tolist() for _ in range(samples)]
with torch.no_grad():
    model(torch.tensor(sequences[:1]))  # the forward's kernels and buffers, before the baseline
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
scores = score_layers(model, sequences, 0, "cpu", budget)
assert sorted(scores) == list(range(1, layers + 1))
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


def _peak_growth_mib(samples: int, layers: int, budget: int = ONE_LAYER) -> int:
    # A fixed mmap threshold: every block of a MiB or more is mapped on allocation and unmapped on
    # release, so the peak is what was alive at once, not what glibc's heap kept after a free.
    # One thread: beside the other xdist worker's engine, two OpenMP threads took 28 s a measurement
    # where one took 6-11 s, with the same peaks (2-core AMD EPYC, AVX512-BF16, float32).
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(2**20), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", PEAK_MEMORY_SCRIPT, str(WIDTH), str(samples), str(layers),
                          str(budget)], capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout.split()[-1])


def test_select_memory_does_not_grow_with_samples_or_layers():
    """With a budget of one layer EDSelect streams: its peak grows neither with the calibration
    set (as it would if each sequence's states or per-class covariances stayed alive) nor with the
    number of layers (one layer per pass)."""
    few, many, deeper = _peak_growth_mib(4, 2), _peak_growth_mib(24, 2), _peak_growth_mib(4, 6)
    assert many - few < BOUND_MIB, (few, many)
    assert deeper - few < BOUND_MIB, (few, deeper)
