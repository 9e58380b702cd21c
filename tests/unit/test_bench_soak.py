"""The soak suite's pure parts, no server: what a round holds, how each record is judged, the
greedy comparison, the /metrics reading, the rules a run breaks and its report."""

from __future__ import annotations

import json

import pytest

from bench.cli import parse
from bench.soak import broken_rules, check, rank_binding
from bench.soak_load import (
    ABANDONED,
    BAD_ACCEPTED,
    CAP_KEY,
    FAILED,
    GOOD_REFUSED,
    OK,
    REFUSED,
    REFUSED_UNNAMED,
    SERVER_ERROR,
    compare_greedy,
    judge,
    outcome,
    round_requests,
)
from bench.soak_report import render
from bench.soak_watch import log_problems, memory_growth, metric_values
from vllm_edsd.errors import EDSDError

PROMPTS = [[{"role": "user", "content": f"prompt {i}"}] for i in range(8)]


def test_a_round_mixes_caps_streams_sampling_and_every_bad_request():
    requests = round_requests(PROMPTS, 16, 4, 1024)
    bodies = [r["body"] for r in requests if "body" in r]
    assert {b.get("vllm_xargs", {}).get(CAP_KEY) for b in bodies if b.get("temperature") == 0} >= {0, 1, 4, None}
    assert {b["stream"] for b in bodies} == {True, False}
    assert any(b["temperature"] > 0 and "seed" in b for b in bodies if "temperature" in b)
    assert sum("walk_away_after" in r for r in requests) == 1
    assert sorted(r["greedy"] for r in requests if "greedy" in r) == list(range(len(PROMPTS)))
    bad = [r for r in requests if "field" in r]
    assert {r["field"] for r in bad} == {CAP_KEY, "context length", "temperature", "top_p", "JSON"}
    raw = next(r["raw"] for r in bad if "raw" in r)
    with pytest.raises(json.JSONDecodeError):
        json.loads(raw)


def record(status, error=None, **extra):
    return {"id": 0, "request": 0, "status": status, "error": error, "token_ids": [], **extra}


@pytest.mark.parametrize(("request_", "rec", "expected"), [
    ({"body": {}}, record(200), OK),
    ({"body": {}}, record(200, abandoned=True), ABANDONED),
    ({"body": {}}, record(400, "HTTP 400"), GOOD_REFUSED),
    ({"body": {}}, record(500, "HTTP 500"), SERVER_ERROR),
    ({"body": {}}, record(200, "truncated stream (no [DONE])"), FAILED),
    ({"body": {}}, record(0, "ConnectionError"), FAILED),
    ({"field": "top_p"}, record(400, "HTTP 400", error_body={"message": "top_p must be in (0, 1], got 2.0."}), REFUSED),
    ({"field": "top_p"}, record(400, "HTTP 400", error_body={"message": "bad", "param": "top_p"}), REFUSED),
    ({"field": "top_p"}, record(422, "HTTP 422", error_body={"message": "something is wrong"}), REFUSED_UNNAMED),
    ({"field": "top_p"}, record(200), BAD_ACCEPTED),
    ({"field": "top_p"}, record(503, "HTTP 503"), SERVER_ERROR),
])
def test_each_record_gets_one_outcome(request_, rec, expected):
    assert outcome(rec, request_) == expected


def test_judging_counts_outcomes_and_lists_faults_with_what_was_sent():
    requests = [{"body": {}, "what": "T=0"}, {"field": "temperature", "what": "temperature -1"}]
    records = [record(200), {**record(500, "HTTP 500"), "request": 1}, {**record(200), "request": 1}]
    verdicts = judge(records, requests)
    assert verdicts["outcomes"] == {OK: 1, SERVER_ERROR: 1, BAD_ACCEPTED: 1}
    assert [f["outcome"] for f in verdicts["faults"]] == [SERVER_ERROR, BAD_ACCEPTED]
    assert verdicts["bad_requests"] == {"temperature -1": {SERVER_ERROR: 1, BAD_ACCEPTED: 1}}


def test_greedy_replies_are_compared_with_their_prompts_reply_alone():
    requests = [{"body": {}, "greedy": 0}, {"body": {}, "greedy": 1}, {"body": {}}]
    records = [{**record(200, token_ids=[1, 2, 3]), "id": 5},
               {**record(200, token_ids=[4, 9, 6]), "id": 6, "request": 1},
               {**record(200, token_ids=[7]), "request": 2},  # not greedy: not compared
               {**record(500, "HTTP 500"), "request": 1}]  # failed: not compared
    greedy = compare_greedy(records, requests, [[1, 2, 3], [4, 5, 6]])
    assert (greedy["compared"], greedy["equal"], greedy["equal_share"]) == (2, 1, 0.5)
    assert greedy["differ"] == [{"prompt": 1, "request": 6, "first_difference_at": 1}]


def test_metrics_sum_every_engine_and_match_names_whole():
    text = ('vllm:num_requests_running{engine="0"} 2.0\nvllm:num_requests_running{engine="1"} 1.0\n'
            'vllm:num_requests_running_total 7.0\nvllm:kv_cache_usage_perc{engine="0"} 0.25\n'
            'vllm:request_success_total{engine="0",finished_reason="length"} 3.0\n')
    series = ("vllm:num_requests_running", "vllm:kv_cache_usage_perc",
              'vllm:request_success_total{engine="0",finished_reason="length"')
    assert list(metric_values(text, series).values()) == [3.0, 0.25, 3.0]


def test_log_problems_are_tracebacks_and_ignored_exceptions():
    log = "INFO fine\nTraceback (most recent call last):\n  File x\nException ignored in: <function>\nERROR y\n"
    assert log_problems(log) == ["Traceback (most recent call last):", "Exception ignored in: <function>"]


def results(**changes) -> dict:
    verdicts = {"outcomes": {OK: 3, REFUSED: 1}, "faults": [], "fault_count": 0,
                "bad_requests": {"top_p 2": {REFUSED: 1}}}
    base = {"command": "python -m bench soak --out x", "machine": {"processor": "cpu", "cores": 2},
            "duration_s": 10, "concurrency": [1], "k": 4, "max_tokens": 8, "server": "started by the suite",
            "shutdown_timeout": 0, "round": ["T=0, cap 0", "top_p 2"],
            "levels": {1: {"requests": 4, "wall_s": 10.0, **verdicts}}, "overall": verdicts,
            "greedy": {"compared": 3, "equal": 3, "equal_share": 1.0, "differ": []},
            "state_after_load": {"vllm:num_requests_running": 0.0, "empty": True}, "serving_log_problems": [],
            "memory_samples": [[0.0, {"a[1]": 100.0}], [2.0, {"a[1]": 110.0}]],
            "shutdown": {"processes": 3, "gone_s": 2.1, "left": [], "limit_s": 30, "log_problems": []}}
    return {**base, **changes}


def test_a_run_that_held_breaks_no_rule_and_its_report_says_so():
    held = results()
    held["broken_rules"] = broken_rules(held)
    assert held["broken_rules"] == []
    report = render(held)
    assert "held: no rule broke" in report and "3 of 3 equal" in report and "the last gone after 2.1 s" in report
    near_tie = {"compared": 20, "equal": 18, "equal_share": 0.9, "differ": [{"prompt": 1, "request": 2,
                                                                           "first_difference_at": 5}] * 2}
    assert broken_rules(results(greedy=near_tie)) == []  # 90 % equal: a 16-bit run's near-ties


def test_every_broken_rule_is_one_line():
    greedy = {"compared": 4, "equal": 3, "equal_share": 0.75, "differ": [{"prompt": 1, "request": 2,
                                                                             "first_difference_at": 5}]}
    verdicts = {**results()["overall"], "outcomes": {OK: 3, SERVER_ERROR: 2}}
    broken = results(overall=verdicts, greedy=greedy, serving_log_problems=["Traceback"],
                     state_after_load={"vllm:kv_cache_usage_perc": 0.5, "empty": False},
                     shutdown={"processes": 3, "gone_s": None, "left": ["VLLM::Worker[9]"], "limit_s": 30,
                               "log_problems": []})
    broken["broken_rules"] = broken_rules(broken)
    assert len(broken["broken_rules"]) == 5, broken["broken_rules"]
    assert "parts at token 5" in render(broken)


def test_replies_parted_the_same_way_are_one_line_and_16_bit_runs_say_why():
    parted = [{"prompt": 0, "request": r, "first_difference_at": 22} for r in (0, 18, 36)]
    greedy = {"compared": 8, "equal": 4, "equal_share": 0.5,
              "differ": [*parted, {"prompt": 4, "request": 8, "first_difference_at": 10}]}
    report = render({**results(greedy=greedy, dtype="bfloat16", tensor_parallel_size=2), "broken_rules": []})
    assert "prompt 0: 3 replies part at token 22" in report and "prompt 4: 1 reply parts at token 10" in report
    assert "scripts/batch_variance.py" in report and "(bfloat16, TP 2)" in report
    assert "batch_variance" not in render({**results(greedy=greedy, dtype="float32"), "broken_rules": []})


def test_bad_soak_values_are_one_line():
    for argv, message in ((["--concurrency", "0"], "--concurrency takes"), (["--concurrency", "64"], "from 1 to 32"),
                          (["--duration", "0"], "--duration must be at least 1"),
                          (["--tensor-parallel-size", "0"], "--tensor-parallel-size must be at least 1")):
        with pytest.raises(EDSDError, match=message):
            check(parse(["soak", "--out", "x", *argv]))


def test_each_rank_gets_its_share_of_the_cores_unless_the_user_bound_them(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    assert rank_binding(1) == {}
    assert rank_binding(2) == {"VLLM_CPU_OMP_THREADS_BIND": "0,1|2,3"}
    with pytest.raises(EDSDError, match="8 ranks .* need as many cores; this process may use 4"):
        rank_binding(8)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    assert rank_binding(2) == {}


def test_memory_grown_from_the_5th_minute_is_measured_and_5_percent_breaks_the_run():
    samples = [[t, {"api[1]": 1000.0, "worker[2]": 3000.0 + t}] for t in range(0, 1201, 100)]
    growth = memory_growth(samples)
    assert growth == {"from_s": 300, "from_mib": 4300, "end_mib": 5200, "growth_percent": 20.93}
    assert memory_growth(samples[:6]) is None  # 500 s: not twice the settling time
    grown = results(memory_growth=growth)
    assert broken_rules(grown) == ["resident memory grew 20.93 % from minute 5 to the end (4300 to 5200 MiB)"]
    report = render({**grown, "broken_rules": []})
    assert "From the 5th minute (300 s, 4300 MiB) to the end (5200 MiB): +20.9 %." in report
    assert broken_rules(results(memory_growth={**growth, "growth_percent": 1.7})) == []
