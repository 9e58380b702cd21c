"""``python -m bench serve``: its held-out ShareGPT prompts, the servers it starts, its report
and its refusals, without a server (the engine test runs it against real servers)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from bench import cli
from bench.vllm_serve import NONE, checked, held_out_sharegpt, render, speculative_configs
from vllm_edsd.errors import EDSDError


def parse(argv: list[str]):
    return checked(cli.parse(["serve", *argv]))


def test_held_out_prompts_are_later_turns_that_no_first_turn_equals():
    from vllm_edsd.data import load_sharegpt

    first_turns = {next((m["content"].strip() for m in c if m["role"] == "user"), "") for c in load_sharegpt(None, 0)}
    records = held_out_sharegpt(12)
    assert len(records) == 12
    for record in records:
        human, gpt = record["conversations"]
        assert (human["from"], gpt["from"]) == ("human", "gpt")
        assert human["value"] not in first_turns and len(human["value"]) >= 64 and gpt["value"].strip()
    assert len({r["conversations"][0]["value"] for r in records}) == 12


def test_speculative_configs_are_labelled_by_what_differs():
    args = parse(["--out", "x", "--target", "T",
                  "--speculative-config", '{"method": "edsd", "model": "D", "num_speculative_tokens": 4}',
                  "--speculative-config", '{"method": "edsd", "model": "D", "num_speculative_tokens": 1, '
                                          '"draft_sample_method": "greedy"}'])
    assert list(speculative_configs(args, {})) == ["edsd K=4", "edsd K=1 draft_sample_method=greedy"]


@pytest.mark.parametrize("argv, message", [
    (["--num-prompts", "0"], "--num-prompts must be at least 1"),
    (["--dtypes", "auto,fp8"], "--dtypes: unknown fp8"),
])
def test_bad_arguments_are_refused(argv, message):
    with pytest.raises(EDSDError, match=message):
        parse(["--out", "x", *argv])


@pytest.mark.parametrize("config, message", [("{not json", "not JSON"), ('["edsd"]', "a JSON object with a method")])
def test_a_bad_speculative_config_is_refused(config, message):
    with pytest.raises(EDSDError, match=message):
        speculative_configs(parse(["--out", "x", "--target", "T", "--speculative-config", config]), {})


def test_the_command_refuses_in_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "bench", "serve", "--out", str(tmp_path / "out"),
                           "--target", "T", "--speculative-config", "{"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("bench serve: error: --speculative-config: not JSON")
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()


def test_the_report_compares_each_server_with_none_at_its_dtype_and_at_the_first():
    def row(label, dtype, tok_s, tau=None):
        drafts = 100 if tau else 0
        return {"label": label, "dtype": dtype, "served_dtype": "float32" if dtype == "float32" else "bfloat16",
                "output_throughput": tok_s, "total_output_tokens": 10 * tok_s, "duration": 10.0,
                "mean_tpot_ms": 1000 / tok_s,
                "counters": {"drafts": drafts, "accepted": round((tau - 1) * drafts) if tau else 0, "tau": tau}}

    results = {"machine": {"processor": "CPU", "cpu_instruction_set": "avx2", "cores": 2, "vllm": "0.32.0"},
               "command": "python -m bench serve --out x", "num_prompts": 24, "output_len": 128,
               "speculative_configs": {"edsd K=4": {"method": "edsd"}},
               "runs": [row(NONE, "auto", 10.0), row("edsd K=4", "auto", 5.0, 1.5),
                        row(NONE, "float32", 20.0), row("edsd K=4", "float32", 25.0, 1.6)]}
    lines = render(results).splitlines()
    assert "| edsd K=4 | auto (bfloat16) | 5.0 | 0.50x | 0.50x | 1.50 | 200.0 ms |" in lines
    assert "| edsd K=4 | float32 (float32) | 25.0 | 1.25x | 2.50x | 1.60 | 40.0 ms |" in lines


def test_rounds_report_each_server_over_its_rounds_and_per_round():
    """Two rounds: a server's tok/s is its tokens over its time, τ its rounds' counters together."""
    def row(label, turn, tokens, seconds, accepted=0, drafts=0):
        return {"label": label, "dtype": "auto", "served_dtype": "bfloat16", "round": turn,
                "total_output_tokens": tokens, "duration": seconds, "output_throughput": tokens / seconds,
                "mean_tpot_ms": 1000 * seconds / tokens,
                "counters": {"accepted": accepted, "drafts": drafts, "tau": 1 + accepted / drafts if drafts else None}}

    results = {"machine": {"processor": "CPU", "cpu_instruction_set": "avx2", "cores": 2, "vllm": "0.32.0"},
               "command": "python -m bench serve --out x --rounds 2", "num_prompts": 24, "output_len": 128,
               "speculative_configs": {"edsd K=4": {"method": "edsd"}},
               "runs": [row(NONE, 1, 100, 10), row("edsd K=4", 1, 100, 5, 50, 100),
                        row("edsd K=4", 2, 300, 5, 150, 100), row(NONE, 2, 100, 10)]}
    lines = render(results).splitlines()
    assert "| none | auto (bfloat16) | 10.0 | 10.0 / 10.0 | - | - | - | 100.0 ms |" in lines
    assert "| edsd K=4 | auto (bfloat16) | 40.0 | 20.0 / 60.0 | 4.00x | 4.00x | 2.00 | 33.3 ms |" in lines
    assert any("every server 2 times, in alternating order" in line for line in lines)
