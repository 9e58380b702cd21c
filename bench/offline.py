"""The offline suites (acceptance, throughput, robustness), through ``LLM.generate``.

One engine per (method, K), shared by every offline suite, category, temperature and batch
size, and freed before the next one starts (two engines do not fit the CPU build's memory
check). Every ``speedup`` divides two throughputs measured in the same run.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from importlib import resources

from vllm_edsd.data import load_humaneval
from vllm_edsd.errors import EDSDError
from vllm_edsd.launch.engine import engine_dtype, llm_session, spec_counters, speculative_config
from vllm_edsd.methods.registry import EAGLE3, EDSD
from vllm_edsd.serving.features.draft_length import DEFAULT_THRESHOLD, REQUEST_KEY, check_request_cap

CATEGORIES = ("chat", "code", "math", "instruction", "summarization")
# The n-gram lengths prompt lookup matches, alone (``ngram``) and beside the drafter
# (EDSD + lookup): 2 to 4 tokens, as vLLM's examples use; vLLM's own default is 5 to 5.
NGRAM_LENGTHS = {"prompt_lookup_min": 2, "prompt_lookup_max": 4}
DEFAULT_METHODS = f"none,ngram,{EAGLE3},{EDSD}"
BATCH_TABLE = f"{EDSD}-batch-table"


def _adaptive(k: int, threshold: float) -> dict:
    return {"adaptive_draft_length": True, "adaptive_draft_threshold": threshold}


# Methods that are another method's drafter under other serving settings: name -> (drafter's
# method, speculative-config fields from K and the adaptive threshold). The batch table is
# vLLM's own K-by-batch-size table (``num_speculative_tokens_per_batch_size``), set from the
# static K figures of this CPU: K up to batch 4, K/2 to 16, 1 above. ``+lookup`` drafts by
# prompt lookup where it matches and by the drafter elsewhere, EDSD's or EAGLE-3's
# (docs/serving.md, "Prompt lookup beside the drafter"); ``-k1+lookup`` lets the drafter draft
# one token there (the lookup up to K); ``-adaptive+lookup`` cuts EDSD's drafts by its entropy there too.
VARIANTS = {
    f"{EDSD}-adaptive": (EDSD, _adaptive),
    BATCH_TABLE: (EDSD, lambda k, threshold: {
        "num_speculative_tokens_per_batch_size": [[1, 4, k], [5, 16, max(1, k // 2)], [17, 17, 1]]}),
    **{f"{method}+lookup": (method, lambda k, threshold: dict(NGRAM_LENGTHS)) for method in (EDSD, EAGLE3)},
    **{f"{method}-k1+lookup": (method, lambda k, threshold: {"num_drafter_tokens": 1, **NGRAM_LENGTHS})
       for method in (EDSD, EAGLE3)},
    f"{EDSD}-adaptive+lookup": (EDSD, lambda k, threshold: {**_adaptive(k, threshold), **NGRAM_LENGTHS}),
}


# Methods that need no drafter, the baselines a user tries before training anything: vLLM's
# prompt lookup, and its suffix decoding (ArcticInference's suffix trees over the prompt and
# earlier replies; needs the arctic-inference package).
TRAINING_FREE = {"ngram": NGRAM_LENGTHS, "suffix": {}}


def drafter_method(method: str) -> str:
    """The method whose drafter ``method`` serves (itself unless it is a variant)."""
    return VARIANTS[method][0] if method in VARIANTS else method


def load_prompts(category: str, limit: int) -> list[list[dict]]:
    """Conversations (message lists ending in a user turn) of one category."""
    if category == "code":
        return [[{"role": "user", "content": "Complete this Python function:\n" + p["prompt"]}]
                for p in load_humaneval()[:limit]]
    data = json.loads(resources.files("bench").joinpath(f"prompts/{category}.json").read_text())
    return data["conversations"][:limit]


def prompt_pool(setup: Setup) -> list[list[dict]]:
    """The prompts of every category the run measures, category after category."""
    return [c for category in setup.categories for c in load_prompts(category, setup.prompts_per_category)]


def system_prompts() -> list[str]:
    return json.loads(resources.files("bench").joinpath("prompts/system_prompts.json").read_text())["system_prompts"]


@dataclass
class Setup:
    """What a benchmark run is pointed at, and how much of it to run."""

    target: str
    drafters: dict[str, str]  # method -> drafter directory
    methods: list[str]
    ks: list[int]
    prompts_per_category: int
    max_tokens: int
    batch_sizes: list[int]
    temperatures: list[float] = field(default_factory=lambda: [0.0])  # throughput's
    acceptance_temperatures: list[float] = field(default_factory=lambda: [0.0, 1.0])  # acceptance's
    mixed_batch: int = 16  # the mixed suite's batch: half its requests opt out of drafting
    # True: every reply is max_tokens long (equal work per method); False: replies end at the
    # model's end of sequence, as users see them (prompt lookup then has no repetition past the
    # answer to copy; docs/results.md, "Measuring: `python -m bench`").
    ignore_eos: bool = True
    adaptive_threshold: float = DEFAULT_THRESHOLD
    categories: tuple[str, ...] = CATEGORIES  # the prompt categories every suite but robustness draws from
    # The engines' dtype (draft-cost has its own --dtypes); None: the CPU's default, bf16 where
    # it is native. float32 keeps speculative replies the target's own, so every method times
    # the same texts.
    dtype: str | None = None
    seed: int = 0  # the offline engines' sampling seed: T>0 rows are one draw of their texts per seed
    eager: bool = False  # engines and servers without torch.compile (--eager, --quick)
    runs: list[dict] = field(default_factory=list)

    def methods_with_k(self) -> list[tuple[str, int]]:
        """(method, K) pairs; "none" once, with K 0."""
        pairs = [("none", 0)] if "none" in self.methods else []
        return pairs + [(m, k) for m in self.methods if m != "none" for k in self.ks]


def method_config(setup: Setup, method: str, k: int, **extra) -> dict | None:
    """The speculative config of (method, K), variants resolved to their drafter's method."""
    if method == "none":
        return None
    if method in TRAINING_FREE:  # no drafter and no draft probabilities
        extra.pop("draft_sample_method", None)
        return speculative_config(method, None, k, **TRAINING_FREE[method], **extra)
    base = drafter_method(method)
    if method in VARIANTS:
        extra.update(VARIANTS[method][1](k, setup.adaptive_threshold))
    return speculative_config(base, setup.drafters.get(base), k, **extra)


def engine(setup: Setup, method: str, k: int):
    """The engine for (method, K); sampled drafts at temperature > 0 (vLLM still drafts
    greedily for greedy requests)."""
    return llm_session(setup.target, method_config(setup, method, k, draft_sample_method="probabilistic"),
                       seed=setup.seed, enforce_eager=setup.eager, **({"dtype": setup.dtype} if setup.dtype else {}))


def sequence_tau(output_tokens: int, accepted: int) -> float | None:
    """Whole-sequence τ: output tokens per target forward of a request. Every forward (the
    prefill's included) gives one token of the target's own plus the drafts it accepted, so the
    forwards are ``output_tokens - accepted``. Unlike τ per draft (1 + accepted / drafts), it
    counts the steps that drafted nothing, so a method that drafts only sometimes (``ngram``) is
    compared with the others on the same terms; without speculation it is 1."""
    return output_tokens / (output_tokens - accepted) if output_tokens > accepted else None


def generate(llm, conversations: list[list[dict]], temperature: float, max_tokens: int, one_at_a_time: bool,
             ignore_eos: bool = True, extra_args: dict | None = None) -> dict:
    """Output tokens/s and the spec-decode counters over these conversations (``extra_args``:
    every request's, such as a draft-length cap)."""
    from vllm import SamplingParams

    # No per-request seed (the engine's own seed=0 stands): vLLM 0.32's CPU build ends the engine
    # when a seeded request's prefill is split across steps at temperature > 0 ("CPU Generator
    # does not use offset", seen in a 64-request batch at T=1).
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=ignore_eos,
                            extra_args=extra_args)
    sources_before = draft_sources(llm)
    before, replies, start = spec_counters(llm), [], time.perf_counter()
    groups = [[c] for c in conversations] if one_at_a_time else [conversations]
    for group in groups:
        replies += [o.outputs[0].token_ids for o in llm.chat(group, params, use_tqdm=False)]
    elapsed = time.perf_counter() - start
    counters = spec_counters(llm) - before
    sources = draft_sources(llm)
    tokens = sum(len(reply) for reply in replies)
    return {
        "dtype": engine_dtype(llm),
        "reply_digests": [reply_digest(reply) for reply in replies],
        "output_tokens": tokens,
        "elapsed_s": elapsed,
        "output_tokens_per_s": tokens / elapsed,
        "tau": counters.mean_acceptance_length,
        "tau_sequence": sequence_tau(tokens, counters.accepted),
        "acceptance_per_pos": counters.acceptance_per_position,
        "drafts": counters.drafts,
        "draft_tokens": counters.draft_tokens,
        "mean_draft_length": counters.mean_draft_length,
        # Draft tokens verified and accepted per source (lookup, drafter): None without a prompt lookup.
        "draft_sources": None if sources is None else {
            source: {key: sources[source][key] - sources_before[source][key] for key in counts}
            for source, counts in sources.items()},
    }


def draft_sources(llm) -> dict[str, dict[str, int]] | None:
    """The prompt lookup's counts per source, summed over the workers (None: no lookup)."""
    from vllm_edsd.serving.features.lookup import WORKER_METHOD, PromptLookup

    spec = llm.llm_engine.vllm_config.speculative_config
    if spec is None or spec.method == "ngram" or PromptLookup.of(spec) is None:
        return None
    workers = [counts for counts in llm.collective_rpc(WORKER_METHOD) if counts]
    if not workers:
        return None
    return {source: {key: sum(w[source][key] for w in workers) for key in workers[0][source]}
            for source in workers[0]}


OFFLINE_SUITES = ("acceptance", "throughput", "robustness", "mixed")


def acceptance(setup: Setup, method: str, k: int, llm) -> list[dict]:
    """τ, per-position acceptance and tokens/s per category and temperature, batch size 1."""
    rows = []
    for temperature in setup.acceptance_temperatures:
        for category in setup.categories:
            result = generate(llm, load_prompts(category, setup.prompts_per_category), temperature,
                              setup.max_tokens, one_at_a_time=True, ignore_eos=setup.ignore_eos)
            rows.append({"suite": "acceptance", "method": method, "k": k, "category": category,
                         "temperature": temperature, "batch_size": 1, **result})
    return rows


def throughput(setup: Setup, method: str, k: int, llm) -> list[dict]:
    """Output tokens/s at each batch size and temperature (chain drafting)."""
    pool = prompt_pool(setup)
    rows = []
    for temperature in setup.temperatures:
        for batch in setup.batch_sizes:
            prompts = [pool[i % len(pool)] for i in range(batch)]
            result = generate(llm, prompts, temperature, setup.max_tokens, one_at_a_time=False,
                              ignore_eos=setup.ignore_eos)
            rows.append({"suite": "throughput", "method": method, "k": k, "batch_size": batch,
                         "temperature": temperature, **result})
    return rows


def robustness(setup: Setup, method: str, k: int, llm) -> list[dict]:
    """τ on the chat prompts under each of the paper's ten system prompts vs none (nothing
    without speculation: there is no τ)."""
    if method == "none":
        return []
    chats = load_prompts("chat", setup.prompts_per_category)
    variants = [("default", None)] + [(f"system-{i}", s) for i, s in enumerate(system_prompts())]
    rows = []
    for name, system in variants:
        convs = chats if system is None else [[{"role": "system", "content": system}, *c] for c in chats]
        result = generate(llm, convs, 0.0, setup.max_tokens, one_at_a_time=False, ignore_eos=setup.ignore_eos)
        rows.append({"suite": "robustness", "method": method, "k": k, "system_prompt": name, "temperature": 0.0,
                     **result})
    return rows


# The mixed suite's three ways of serving one batch: every request at K, every request opted
# out, and the odd-numbered half opted out (None: no cap, the engine's K).
MIXED_RUNS = {"all-K": lambda i: None, "all-off": lambda i: 0, "half-off": lambda i: 0 if i % 2 else None}
HALVES = ("even", "odd")  # even-numbered requests draft in half-off; odd-numbered ones opt out


def mixed(setup: Setup, method: str, k: int, llm) -> list[dict]:
    """A batch where half the requests opt out of drafting (``extra_args={"num_speculative_tokens":
    0}``): each half's output tokens/s, from its start to its last token, against the same
    batch served all at K and all opted out, in the same engine (docs/results.md, "Per-request
    draft length")."""
    if method == "none":
        return []
    try:
        check_request_cap({REQUEST_KEY: 0}, llm.llm_engine.vllm_config)
    except EDSDError as exc:
        print(f"bench: skipping the mixed suite for {method}: {exc}")
        return []
    from vllm import SamplingParams

    pool = prompt_pool(setup)
    batch = [pool[i % len(pool)] for i in range(setup.mixed_batch)]
    rows = []
    for run, cap_of in MIXED_RUNS.items():
        params = [SamplingParams(temperature=0.0, max_tokens=setup.max_tokens, ignore_eos=setup.ignore_eos,
                                 extra_args=None if cap_of(i) is None else {REQUEST_KEY: cap_of(i)})
                  for i in range(len(batch))]
        before, start = spec_counters(llm), time.monotonic()  # vLLM stamps tokens with time.monotonic()
        outputs = llm.chat(batch, params, use_tqdm=False)
        counters = spec_counters(llm) - before
        for parity, half in enumerate(HALVES):
            mine = outputs[parity::2]
            tokens = sum(len(o.outputs[0].token_ids) for o in mine)
            elapsed = max(o.metrics.last_token_ts for o in mine) - start
            rows.append({"suite": "mixed", "method": method, "k": k, "batch_size": len(batch), "run": run,
                         "half": half, "drafting": cap_of(parity) is None, "temperature": 0.0,
                         "dtype": engine_dtype(llm), "output_tokens": tokens, "elapsed_s": elapsed,
                         "output_tokens_per_s": tokens / elapsed, "tau": counters.mean_acceptance_length})
    return rows


MEASURE = {"acceptance": acceptance, "throughput": throughput, "robustness": robustness, "mixed": mixed}


def reply_digest(token_ids) -> str:
    """A short fingerprint of one reply's token ids: rows of one run compare their texts by it."""
    return hashlib.sha256(json.dumps(list(token_ids)).encode()).hexdigest()[:16]


def offline(setup: Setup, method: str, k: int, suites: list[str], round_number: int = 0) -> list[dict]:
    """The rows of every offline suite in ``suites`` for (method, K), all from one engine (an
    engine start costs more than most suites' measurements on a CPU), each marked with its
    round (``--rounds``: the run's engines, again)."""
    with engine(setup, method, k) as llm:
        warm_up(setup, llm)
        return [{**row, "round": round_number} for suite in suites for row in MEASURE[suite](setup, method, k, llm)]


def warm_up(setup: Setup, llm) -> None:
    """A few tokens greedy and sampled before anything is timed: an engine's first requests pay
    one-time costs (lazy initialisation, the sampled path's first call) that would otherwise land
    in whichever measurement comes first."""
    first = load_prompts(setup.categories[0], 1)  # the pool's first prompt, without reading every category
    for temperature in (0.0, 1.0):
        generate(llm, first, temperature, 8, one_at_a_time=False)


def with_derived(runs: list[dict]) -> list[dict]:
    """``runs`` with each row's figures relative to others of the same run: ``speedup`` over
    the no-speculation row (acceptance: same category, temperature and round; throughput: same
    batch size, temperature and round), ``same_replies`` (at T=0: how many replies equal that row's, token
    for token; bf16 rounding can change a reply at a near-tie, docs/results.md, "Measuring: `python -m bench`") and
    robustness's ``tau_drop`` against no system prompt."""
    for suite, keys in (("acceptance", ("category", "temperature")), ("throughput", ("batch_size", "temperature"))):
        rows = [r for r in runs if r["suite"] == suite]
        base = {(*(r[key] for key in keys), r.get("round", 0)): r for r in rows if r["method"] == "none"}
        for r in rows:
            ref = base.get((*(r[key] for key in keys), r.get("round", 0)))
            r["speedup"] = None if ref is None else r["output_tokens_per_s"] / ref["output_tokens_per_s"]
            greedy = ref is not None and r["temperature"] == 0 and "reply_digests" in r
            r["same_replies"] = sum(map(str.__eq__, r["reply_digests"], ref["reply_digests"])) if greedy else None
    robust = [r for r in runs if r["suite"] == "robustness"]
    default = {(r["method"], r["k"]): r["tau"] for r in robust if r["system_prompt"] == "default"}
    for r in robust:
        tau = default.get((r["method"], r["k"]))
        r["tau_drop"] = None if not tau or r["tau"] is None else (r["tau"] - tau) / tau
    return runs
