"""The OpenAI server on the fitted target: its arguments, completion requests and their token ids,
streams a client abandons, the engines that drafted (``/metrics``) and the processes it left."""

from __future__ import annotations

import json
from pathlib import Path

from support.prompts import FITTED_TOKENS

# The OpenAI server on the fitted target: float32 and eager like the reference.
SERVER_ARGS = ["--served-model-name", "toy", "--dtype", "float32", "--enforce-eager", "--max-model-len", "1024"]


def completion_body(prompts: list[list[int]], **extra) -> dict:
    """A greedy completion request for token-id prompts whose answer carries token ids."""
    return {"model": "toy", "prompt": prompts, "max_tokens": FITTED_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_tokens_as_token_ids": True, "logprobs": 1, **extra}


def answer_token_ids(answer: dict) -> list[list[int]]:
    """The token ids of a completion answer's choices, in prompt order."""
    choices = sorted(answer["choices"], key=lambda c: c["index"])
    return [[int(t.split(":", 1)[1]) for t in c["logprobs"]["tokens"]] for c in choices]


def completion_token_ids(base: str, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy completions of token-id prompts, as token ids, in prompt order."""
    import requests

    return answer_token_ids(requests.post(f"{base}/v1/completions", json=completion_body(prompts), timeout=300).json())


def drafting_engines(metrics: str) -> set[str]:
    """The engine indices whose ``/metrics`` series count at least one draft."""
    return {line.split('engine="', 1)[1].split('"', 1)[0] for line in metrics.splitlines()
            if line.startswith("vllm:spec_decode_num_drafts_total{") and float(line.rsplit(" ", 1)[1]) > 0}


def abandon_streams(url: str, bodies: list[dict], events: int = 4, patience_s: float = 1.0) -> list[int]:
    """Stream each request body (in parallel) and walk away, as a client that loses interest
    does: after ``events`` server-sent events, or ``patience_s`` seconds without the next one
    (a reply whose tokens have no text sends none), once the first has come. Returns how many
    events each read before it closed the connection."""
    import http.client
    import threading
    from urllib.parse import urlsplit

    where = urlsplit(url)
    read: list[int] = []

    def walk_away(body: dict) -> None:
        connection, seen = http.client.HTTPConnection(where.hostname, where.port, timeout=120), 0
        try:
            connection.request("POST", where.path, json.dumps({**body, "stream": True}),
                               {"Content-Type": "application/json"})
            reply = connection.getresponse()
            while seen < events:
                line = reply.readline()
                if not line:
                    break
                if line.startswith(b"data:"):
                    seen += 1
                    connection.sock.settimeout(patience_s)  # the first event came: from now on, impatient
        except TimeoutError:
            pass
        finally:
            read.append(seen)
            connection.close()  # the server sees the client gone

    threads = [threading.Thread(target=walk_away, args=(body,)) for body in bodies]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return read


def processes_with(marker: str) -> list[int]:
    """Pids of processes whose environment holds ``marker`` (vLLM's spawned engine processes
    inherit the server's environment, not its command line)."""
    pids = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if marker.encode() in (proc / "environ").read_bytes():
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids
