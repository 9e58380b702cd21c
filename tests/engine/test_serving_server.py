"""The OpenAI-compatible server with ``--speculative-config '{"method":"edsd",...}'``:
completions and chat, streaming and not, the spec-decode counters on /metrics, and a request's
own draft length through ``vllm_xargs``."""

from __future__ import annotations

import _thread
import json
import signal
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
from support.engine_checks import assert_counters_match, predicted_counters
from support.engine_runs import assert_no_traceback, serve_fitted
from support.servers import SERVER_ARGS, answer_token_ids, completion_body, completion_token_ids, processes_with

from vllm_edsd.errors import EDSDError
from vllm_edsd.launch.engine import make_llm, on_cpu, parse_prometheus_counters
from vllm_edsd.launch.server import post_json, running_server

K = 4


@pytest.fixture(scope="module")
def server(trained, tmp_path_factory):
    """The fitted target with the trained EDSD drafter, converted with its token norm folded."""
    spec = {"method": "edsd", "model": trained["edsd-folded"], "num_speculative_tokens": K}
    log = tmp_path_factory.mktemp("server") / "server.log"
    with running_server(trained["target"], spec, extra_args=SERVER_ARGS, log_path=log) as base:
        yield base
        assert_no_traceback(log, "the EDSD server, while serving")


def counters(base: str):
    return parse_prometheus_counters(requests.get(f"{base}/metrics", timeout=10).text)


def test_completion_is_lossless_and_counts_match_the_reference(server, trained, engine_runs):
    """Served output is the target's own, and /metrics counts what the reference drafter
    predicts: a folded drafter whose drafts depend on every weight, accepted often."""
    before = counters(server)
    outputs = completion_token_ids(server, trained["prompts"])
    assert outputs == serve_fitted(trained, engine_runs, "pipeline-none", None)["outputs"]
    grown = counters(server) - before
    assert grown.draft_tokens == K * grown.drafts
    assert_counters_match(predicted_counters(trained, outputs, K), grown.as_dict())


def test_a_bad_per_request_draft_length_fails_its_own_request_only(server, trained, plain_outputs):
    """Good and bad caps sent at once through ``vllm_xargs``: each bad one gets a 400 naming
    the field, every good one the target's output, and the server serves on."""
    xargs = [{"num_speculative_tokens": 9}, {"num_speculative_tokens": 0}, {"num_speculative_tokens": "two"},
             {"num_speculative_tokens": 1}, {"num_speculative_tokens": -1}, {}, {"num_speculative_tokens": 2.5},
             {"num_speculative_tokens": 4}]
    bad = {0, 2, 4, 6}

    def ask(i: int) -> requests.Response:
        body = completion_body([trained["prompts"][i]], vllm_xargs=xargs[i])
        return requests.post(f"{server}/v1/completions", json=body, timeout=300)

    before = counters(server)
    with ThreadPoolExecutor(len(xargs)) as pool:
        answers = list(pool.map(ask, range(len(xargs))))
    after = requests.post(f"{server}/v1/completions", json=completion_body(trained["prompts"]), timeout=300)
    grown = counters(server) - before
    for i, answer in enumerate(answers):
        if i in bad:
            assert answer.status_code == 400, answer.text
            assert "num_speculative_tokens" in answer.json()["error"]["message"], answer.text
            assert "from 0 (no drafts) to 4" in answer.json()["error"]["message"], answer.text
        else:
            assert answer.status_code == 200, answer.text
            assert answer_token_ids(answer.json()) == [plain_outputs[i]]
    assert after.status_code == 200 and answer_token_ids(after.json()) == plain_outputs
    assert 0 < grown.draft_tokens < K * grown.drafts  # the capped requests drafted fewer than K


def test_a_refused_request_is_one_error_with_the_servers_reason(server):
    """A request the server refuses (its reply would not fit the context) is one EDSDError
    carrying vLLM's own message, as ``edsd demo`` and the bench print it."""
    body = {"model": "toy", "prompt": "def fibonacci(n):", "max_tokens": 100000, "temperature": 0}
    with pytest.raises(EDSDError, match=r"the server refused the request \(HTTP 400\): .*100000"):
        post_json(f"{server}/v1/completions", body)


def test_streaming_completion_matches_non_streaming(server):
    body = {"model": "toy", "prompt": "def fibonacci(n):", "max_tokens": 24, "temperature": 0}
    whole = requests.post(f"{server}/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
    pieces = []
    with requests.post(f"{server}/v1/completions", json={**body, "stream": True}, stream=True, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                pieces.append(json.loads(line[6:])["choices"][0]["text"])
    assert len(pieces) > 1
    assert "".join(pieces) == whole


def test_chat_completions(server):
    messages = [{"role": "user", "content": "Write a haiku about the sea."}]
    body = {"model": "toy", "messages": messages, "max_tokens": 16, "temperature": 0}
    reply = requests.post(f"{server}/v1/chat/completions", json=body, timeout=120).json()
    text = reply["choices"][0]["message"]["content"]
    assert reply["usage"]["completion_tokens"] > 0
    pieces = []
    with requests.post(f"{server}/v1/chat/completions", json={**body, "stream": True}, stream=True, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                delta = json.loads(line[6:])["choices"][0]["delta"]
                pieces.append(delta.get("content") or "")
    assert "".join(pieces) == text


def _interrupt_when_logged(log: Path, text: str, done: threading.Event) -> None:
    """Raise KeyboardInterrupt in the main thread (as Ctrl-C would) once ``text`` is in ``log``;
    the watcher ends when ``done`` is set, so it can never interrupt a later test."""
    def watch():
        while not done.wait(0.2):
            if log.exists() and text in log.read_text():
                _thread.interrupt_main()
                return
    threading.Thread(target=watch, daemon=True).start()


def test_server_interrupted_during_start_up_leaves_no_engine_process(models, tmp_path):
    """Ctrl-C while the server starts stops the API server and the engine core it had already
    spawned. The interrupt is sent once the engine core has logged, however slow the machine."""
    marker = f"EDSD_TEST_MARKER={uuid.uuid4().hex}"
    log = tmp_path / "startup.log"
    # Python's own Ctrl-C handling, whatever an engine built in this process earlier installed.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    done = threading.Event()
    try:
        _interrupt_when_logged(log, "EngineCore", done)
        with pytest.raises(KeyboardInterrupt):
            with running_server(models["llama"], log_path=log,
                                env={marker.split("=")[0]: marker.split("=")[1]}):
                pytest.fail("the server became healthy before the engine core logged")
    finally:
        done.set()
        signal.signal(signal.SIGINT, previous)
    assert _gone_within(marker, limit_s=10)


def _gone_within(marker: str, limit_s: float) -> bool:
    deadline = time.time() + limit_s
    while processes_with(marker) and time.time() < deadline:
        time.sleep(0.5)
    return processes_with(marker) == []


def test_server_start_up_time_out_is_one_clear_error(models, tmp_path):
    """A server that is not healthy in time gives the project's error with the log's tail."""
    with pytest.raises(EDSDError, match="not healthy after 1 s"):
        with running_server(models["llama"], log_path=tmp_path / "startup.log", startup_timeout_s=1):
            pass


def test_health_poll_outlasts_a_server_that_does_not_answer_yet(tmp_path):
    """A server busy starting its engine accepts connections but answers ``/health`` late:
    the wait treats a read time-out as "not yet" and ends, at its deadline, with the one
    start-up error, not a ``requests`` ReadTimeout traceback."""
    import socket
    import subprocess
    import sys

    from vllm_edsd.launch.server import wait_until_healthy

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # accepts (the kernel completes the handshake) and never replies
        port = silent.getsockname()[1]
        alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        try:
            with open(tmp_path / "server.log", "w+") as log:
                log.write("INFO starting the engine\n")
                started = time.time()
                with pytest.raises(EDSDError, match="not healthy after 5 s") as err:
                    wait_until_healthy(f"http://127.0.0.1:{port}", alive, 5, log)
        finally:
            alive.kill()
            alive.wait()
    assert "starting the engine" in str(err.value)  # the log is quoted
    assert time.time() - started >= 5


def test_server_that_fails_to_start_names_vllms_reason(models, tmp_path, monkeypatch):
    """An engine that cannot start (here: a KV cache too small for one sequence, which is how a
    CPU whose NUMA node reports little memory failed the demo) is one error carrying vLLM's own
    reason from the engine core's log, not the API server's "see root cause above" traceback."""
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)  # the tests' KV size would override 4 KiB
    with pytest.raises(EDSDError) as err:
        with running_server(models["llama"], extra_args=[*SERVER_ARGS, "--kv-cache-memory-bytes", "4096"],
                            log_path=tmp_path / "startup.log"):
            pytest.fail("the server started with a 4 KiB KV cache")
    message = str(err.value)
    assert "during start-up: ValueError:" in message and "memory" in message, message
    assert "Traceback" not in message and "\n" not in message, message
    if on_cpu():  # the fraction vLLM advises raising is the launcher's there
        assert "EDSD_CPU_MEMORY_FRACTION" in message, message


def test_offline_engine_that_fails_to_start_is_one_error(models, monkeypatch):
    """``LLM(...)`` through the launcher (the demo's ``--offline``, the bench): an engine core
    that cannot start is the project's error pointing at vLLM's logged reason, which vLLM's own
    exception ("See root cause above") only refers to."""
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    with pytest.raises(EDSDError, match="vLLM's engine failed to start") as err:
        make_llm(models["llama"], kv_cache_memory_bytes=4096, dtype="float32", enforce_eager=True)
    if on_cpu():
        assert "EDSD_CPU_MEMORY_FRACTION" in str(err.value)
