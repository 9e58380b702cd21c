"""Regeneration: the target's own greedy answers to the training prompts, turn by turn, so that
a drafter learns the target's distribution (docs/scale.md), through vLLM's batched generation
or, where vLLM is not installed, transformers (``greedy``). Answers are cached in chunks under
a key of everything they depend on: a rerun answers only the chunks not yet written.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from vllm_edsd.checkpoint.files import checkpoint_fingerprint, replace_file
from vllm_edsd.checkpoint.target import context_length
from vllm_edsd.data import template_ids
from vllm_edsd.errors import EDSDError
from vllm_edsd.launch.transformers_target import default_device, device_dtype, load_target

REGENERATE_CHUNK = 256  # conversations per cached file: an interrupted regeneration loses at most one
GENERATION_BACKENDS = ("auto", "vllm", "transformers")
# chunks answered together: transformers batches only what it is given, vLLM batches continuously
CHUNKS_PER_CALL = {"vllm": 1, "transformers": 4}


def regenerate(
    target: str, conversations: list, cache_dir: Path, max_tokens: int, engine_args: dict | None = None,
    *, backend: str = "auto", device: str | None = None,
) -> list:
    """Replace every assistant turn by the target's own greedy answer, turn by turn, batched,
    through vLLM or transformers (``backend``; transformers on ``device``). Cached in
    ``cache_dir`` in chunks of ``REGENERATE_CHUNK`` conversations, each under a key of
    everything its answers depend on (``regenerated_paths``): a rerun regenerates only the
    chunks not yet written, and a run with other inputs never reuses stale answers. The backend
    and ``engine_args`` (vLLM's ``LLM(...)``: tensor parallelism...) change how, not what, is
    computed (greedy answers differ only at near-ties of the two numerics). A target without a
    chat template is refused before any work (``require_chat_template``); a turn whose prompt
    does not fit the target's context ends its conversation there, counted in one line."""
    chunks = [conversations[i : i + REGENERATE_CHUNK] for i in range(0, len(conversations), REGENERATE_CHUNK)]
    paths = regenerated_paths(target, chunks, cache_dir, max_tokens, (engine_args or {}).get("max_model_len"))
    missing = [i for i, path in enumerate(paths) if not path.exists()]
    if missing:
        backend = generation_backend(backend, engine_args)
        require_chat_template(target)
        cache_dir.mkdir(parents=True, exist_ok=True)
        per_call, stopped = CHUNKS_PER_CALL[backend], 0
        with replier(backend, target, max_tokens, engine_args, device) as (reply, window):
            for start in range(0, len(missing), per_call):
                group = missing[start : start + per_call]
                print(f"regenerating chunks {start + 1}-{start + len(group)} of {len(missing)} "
                      f"({sum(len(chunks[i]) for i in group)} conversations)")
                answered, ended = answer_turns(reply, [c for i in group for c in chunks[i]])
                answers, stopped = iter(answered), stopped + ended
                for i in group:
                    mine = [c for c in (next(answers) for _ in chunks[i]) if any(m["role"] == "assistant" for m in c)]
                    replace_file(paths[i], lambda tmp: tmp.write_text("".join(json.dumps(c) + "\n" for c in mine)))  # noqa: B023
        if stopped:
            print(f"regeneration: {stopped} conversation{'s' * (stopped != 1)} end{'s' * (stopped == 1)} before a "
                  f"turn whose prompt leaves no room for an answer in the target's {window} tokens; those left "
                  "without any answer are dropped")
    return [json.loads(line) for path in paths for line in path.read_text().splitlines()]


# the tokenizer files that hold the chat template, which turns each chat into the prompt answered
CHAT_TEMPLATE_FILES = ("tokenizer_config.json", "chat_template.jinja", "chat_template.json")


def regenerated_paths(
    target: str, chunks: list[list], cache_dir: Path, max_tokens: int, max_model_len: int | None = None
) -> list[Path]:
    """Each chunk's cache file, named by a hash of everything its answers depend on: the
    target's path and the content fingerprint of its config and weights (retrained weights in
    the same directory answer differently), its chat template, ``max_tokens``, the engine's
    ``max_model_len`` where one is given (it decides which turns fit and where answers stop;
    without one it is the target's own context, which the fingerprint covers) and the chunk's
    conversations."""
    templates = [(Path(target) / name).read_text() if (Path(target) / name).is_file() else None
                 for name in CHAT_TEMPLATE_FILES]
    identity = [str(Path(target).resolve()), checkpoint_fingerprint(target), templates, max_tokens]
    if max_model_len is not None:
        identity.append({"max_model_len": max_model_len})
    keys = [hashlib.sha256(json.dumps([*identity, chunk]).encode()).hexdigest()[:16] for chunk in chunks]
    return [cache_dir / f"regenerated-{key}.jsonl" for key in keys]


def require_chat_template(target: str) -> None:
    """Regeneration has the target answer chats, which its chat template turns into prompts
    (vLLM's ``LLM.chat`` and ``greedy_replies`` alike): a target without one, as most base
    models are, is refused in one line saying what to do, instead of transformers' traceback
    mid-run."""
    from transformers import AutoTokenizer

    if AutoTokenizer.from_pretrained(target).chat_template is None:
        raise EDSDError(f"{target}: its tokenizer has no chat template (a base model?), and regeneration has the "
                        "target answer chats; give it one (a chat_template.jinja, or 'chat_template' in its "
                        "tokenizer_config.json), or skip regeneration and train on conversations whose answers are "
                        "already written (--data)")


def generation_backend(backend: str, engine_args: dict | None = None) -> str:
    """``vllm`` or ``transformers``: ``auto`` is vLLM where it is installed, else transformers,
    with one line saying so."""
    if backend not in GENERATION_BACKENDS:
        raise EDSDError(f"unknown regeneration backend {backend!r}; choose from {', '.join(GENERATION_BACKENDS)}")
    if backend == "auto":
        try:
            import vllm  # noqa: F401

            backend = "vllm"
        except ImportError:
            backend = "transformers"
            print("regeneration through transformers: vLLM is not installed")
    if backend == "transformers" and engine_args:
        raise EDSDError(f"vLLM engine arguments {sorted(engine_args)} were given, but the regeneration runs "
                        "through transformers; install vLLM or drop them")
    return backend


Reply = Callable[[list], list[str | None]]


@contextmanager
def replier(
    backend: str, target: str, max_tokens: int, engine_args: dict | None, device: str | None
) -> Iterator[tuple[Reply, int | None]]:
    """A function from chats to the target's greedy replies, through ``backend``, and the
    tokens a sequence may hold there (vLLM's engine: its ``max_model_len``; transformers: the
    target's context). A chat whose prompt leaves no room for an answer gets None: vLLM would
    refuse the whole batch for it. Both backends answer the prompts the chat template renders
    here (``template_ids``), so the length checked is the length run."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target)
    if backend == "vllm":
        from vllm import SamplingParams

        from vllm_edsd.launch.engine import llm_session, use_every_cpu_core

        params = SamplingParams(temperature=0, max_tokens=max_tokens)
        use_every_cpu_core()
        with llm_session(target, **(engine_args or {})) as llm:
            window = llm.llm_engine.model_config.max_model_len
            run = lambda prompts: [reply.outputs[0].text for reply in llm.generate(  # noqa: E731
                [{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=True)]
            yield fitting(run, tokenizer, window), window
        return
    from .greedy import greedy_answers

    device = default_device(device)
    model = load_target(target, dtype=getattr(torch, device_dtype(device)), device=device)
    budget = TOKEN_BUDGET["cpu" if device == "cpu" else "accelerator"]
    window = context_length(target)
    yield fitting(lambda prompts: greedy_answers(model, tokenizer, prompts, max_tokens, token_budget=budget,
                                                 window=window), tokenizer, window), window


def fitting(run: Callable[[list[list[int]]], list[str]], tokenizer, window: int | None) -> Reply:
    """``run``'s replies to the chats whose prompt, rendered by the chat template, is shorter
    than ``window`` tokens; None for the others."""
    def reply(chats: list) -> list[str | None]:
        prompts = [template_ids(tokenizer, chat, generation_prompt=True) for chat in chats]
        fits = [window is None or len(ids) < window for ids in prompts]
        answers = iter(run([ids for ids, ok in zip(prompts, fits) if ok]) if any(fits) else [])
        return [next(answers) if ok else None for ok in fits]

    return reply


# prompt + answer tokens per transformers batch (left-padded): bounds the KV cache
TOKEN_BUDGET = {"cpu": 1 << 14, "accelerator": 1 << 19}


def answer_turns(reply: Reply, conversations: list) -> tuple[list, int]:
    """The conversations with each assistant turn ``reply``'s answer to the turns before it
    (batched per turn), in order, and how many ended early: a turn ``reply`` cannot answer
    (its prompt does not fit the target) ends its conversation before it. A conversation
    without a user turn stays without answers."""
    out = [[m for m in conv[:1] if m["role"] == "system"] for conv in conversations]
    users = [[m for m in conv if m["role"] == "user"] for conv in conversations]
    ended: set[int] = set()
    for turn in range(max(len(u) for u in users)):
        active = [i for i, u in enumerate(users) if turn < len(u) and i not in ended]
        for i, text in zip(active, reply([[*out[i], users[i][turn]] for i in active])):
            if text is None:
                ended.add(i)
            else:
                out[i] += [users[i][turn], {"role": "assistant", "content": text}]
    return out, len(ended)
