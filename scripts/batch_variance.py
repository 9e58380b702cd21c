"""Does the target's own greedy reply depend on the batch it runs in? No speculation at all.

``python scripts/batch_variance.py [--target DIR] [--dtype bfloat16] [--prompts 8]``

Each of the bench's chat prompts is generated greedily alone (every decode step one token,
one row), then all of them in one batch (many rows a step), by one ``vllm.LLM`` without a
drafter. A prompt whose two replies differ shows vLLM's own batch variance in that dtype: a
one-row step is rounded otherwise than the same row in a larger batch, and a near-tie between
two tokens parts the reply. A speculative server shows the same parting for requests capped at
0 drafts (one token a step alone, beside drafted requests under load), which is why the soak
suite (``python -m bench soak``) compares greedy replies exactly only in float32.

Prints one line per prompt (equal, or the token where the replies part) and the dtype.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the bench package, from a checkout

from bench.arguments import target_and_drafter  # noqa: E402
from bench.offline import load_prompts  # noqa: E402
from vllm_edsd.launch.replies import first_difference  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", help="the target's directory (default: the embedded demo target)")
    parser.add_argument("--dtype", default="bfloat16", help="the engine's dtype (default bfloat16)")
    parser.add_argument("--prompts", type=int, default=8, help="the bench's chat prompts (default 8)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per reply (default 64)")
    args = parser.parse_args()
    from vllm import LLM, SamplingParams

    target, _ = target_and_drafter(args.target, "none", None)
    llm = LLM(target, dtype=args.dtype, gpu_memory_utilization=0.25, max_model_len=2048, seed=0)
    sampling = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    conversations = load_prompts("chat", args.prompts)
    alone = [llm.chat(c, sampling, use_tqdm=False)[0].outputs[0].token_ids for c in conversations]
    batched = [o.outputs[0].token_ids for o in llm.chat(conversations, sampling, use_tqdm=False)]
    print(f"{args.dtype}, greedy, {args.max_tokens} tokens, one prompt at a time against all {len(alone)} in a batch:")
    for index, (one, many) in enumerate(zip(alone, batched)):
        part = first_difference(list(one), list(many))
        print(f"  prompt {index}: {'equal' if part is None else f'parts at token {part}'}")


if __name__ == "__main__":
    main()
