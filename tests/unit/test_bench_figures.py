"""Every figure the bench writes names its dtype."""

from __future__ import annotations


def test_every_bench_figure_names_its_dtype():
    from bench.report import render

    machine = {"processor": "cpu", "cores": 2, "accelerator": "none", "vllm": "0", "torch": "0", "vllm_edsd": "0",
               "cpu_instruction_set": "avx512_bf16 avx2", "default_dtype": "bfloat16"}
    row = {"suite": "throughput", "method": "edsd", "k": 4, "temperature": 0.0, "batch_size": 1, "dtype": "bfloat16",
           "output_tokens_per_s": 1.0, "speedup": 1.0, "tau": 2.0, "mean_draft_length": 4.0}
    report = render({"machine": machine, "config": {"target": "t", "drafters": {}, "command": "c"}, "runs": [row]})
    assert "avx512_bf16" in report and "| dtype |" in report and "| bfloat16 |" in report
