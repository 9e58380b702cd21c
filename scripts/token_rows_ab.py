"""A/B of EDSD's token rows inside one engine (float32, demo pair, K=4, batch 1): the rows on and off in
alternating rounds of 4 prompts, 96 tokens each; `python scripts/token_rows_ab.py [eager]`."""
import os
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def toggle(worker, on):
    m = worker.model_runner.drafter.model
    if not hasattr(m, "_saved_rows"):
        m._saved_rows = m.token_rows
    m.token_rows = m._saved_rows if on else None
    return m.token_rows is not None


if __name__ == "__main__":
    from vllm import SamplingParams

    from vllm_edsd.demo.target import demo_target
    from vllm_edsd.launch.engine import make_llm
    eager = "eager" in sys.argv
    spec = {"method": "edsd", "model": "vllm_edsd/assets/demo/edsd", "num_speculative_tokens": 4}
    llm = make_llm(str(demo_target()), spec, dtype="float32", enforce_eager=eager)
    prompts = ["Write a short story about a robot who learns to paint.",
               "Explain how a hash map works, with an example in Python.",
               "What is 17 times 23? Show your steps.", "Summarize the plot of Romeo and Juliet in five sentences."]
    sp = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
    llm.generate(prompts[:1], sp, use_tqdm=False)
    times = {True: [], False: []}
    texts = {True: [], False: []}
    for rnd in range(4):
        for on in ((True, False) if rnd % 2 == 0 else (False, True)):
            assert llm.collective_rpc(toggle, args=(on,))[0] == on
            for p in prompts:
                t = time.perf_counter()
                out = llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids
                times[on].append(time.perf_counter() - t)
                texts[on].append(list(out))
    for on in (True, False):
        rate = 96 * len(times[on]) / sum(times[on])
        print("rows" if on else "matmuls", "total s", round(sum(times[on]), 2), "tok/s", round(rate, 2))
    print("same texts:", texts[True] == texts[False])
