"""EDSelect's memory at a realistic width: each measurement is a fresh process scoring the
layers of a random hidden-2048 Llama (minutes on a CPU)."""

from __future__ import annotations

PEAK_MEMORY_SCRIPT = """
import resource, sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
from vllm_edsd.selection.scoring import score_layers

samples, layers, budget = (int(a) for a in sys.argv[1:4])
torch.manual_seed(0)
config = LlamaConfig(hidden_size=2048, intermediate_size=512, num_hidden_layers=layers, num_attention_heads=16,
                     num_key_value_heads=4, vocab_size=256, max_position_embeddings=256)
model = LlamaForCausalLM(config).eval()
sequences = [torch.randint(0, 256, (48,)).tolist() for _ in range(samples)]
score_layers(model, sequences[:2], 0, "cpu", budget)  # warm-up: allocator and kernels
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
scores = score_layers(model, sequences, 0, "cpu", budget)
assert sorted(scores) == list(range(1, layers + 1))
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


def _peak_growth_mib(samples: int, layers: int, budget: int) -> int:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", PEAK_MEMORY_SCRIPT, str(samples), str(layers), str(budget)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout.split()[-1])


def test_select_memory_does_not_grow_with_samples_or_layers():
    """At a realistic width (hidden 2048) EDSelect streams: one layer's statistics are two
    D×D float64 matrices (64 MiB here), and the peak does not grow with the calibration set
    (each sequence's states and per-class covariances once stayed alive) nor, with one layer
    per pass, with the number of layers."""
    one_layer = 2 * 2048 * 2048 * 8 + 4096 * 2048 * 4
    few, many = _peak_growth_mib(4, 2, one_layer), _peak_growth_mib(24, 2, one_layer)
    deeper = _peak_growth_mib(24, 6, one_layer)
    assert many - few < 48, (few, many)
    assert deeper - many < 48, (many, deeper)
