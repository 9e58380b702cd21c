"""Run one real vLLM engine in a fresh process and report what it did, as JSON.

Engine tests describe a job (target, speculative config, engine options, and phases of
prompts + sampling parameters; the target may be a drafter directory served alone, with no
speculative config: docs/formats.md, "Speculators format"); this script builds the engine once, runs the phases in
order and writes token ids, vLLM's spec-decode counters, preemptions and what the prefix cache
held (per request and vLLM's counters) per phase and, on request, the draft tokens the drafter
proposed, the drafter model's forwards and the prompt lookup's counts per draft source (read
out of the worker with ``collective_rpc``).
A separate process per engine keeps engines from sharing memory or state between tests
and turns an engine crash into a readable test failure.

Usage: python engine_job.py JOB.json OUT.json
       python engine_job.py --forks     (jobs read from stdin, each run in a fork: ``serve_forks``)
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import time


def _drafter(worker):
    """The object whose ``propose`` returns the drafts: Model Runner V1's ``drafter`` (what
    the CPU build runs) or V2's ``speculator`` (vLLM's default on CUDA)."""
    runner = worker.model_runner
    drafter = getattr(runner, "drafter", None)
    return drafter if drafter is not None else runner.speculator


def _install_recorder(worker) -> None:
    """Wrap the drafter's ``propose`` to keep every chain of draft tokens it returns, and the
    per-request draft-length cap (``extra_args["num_speculative_tokens"]``) of each row."""
    drafter = _drafter(worker)
    if getattr(drafter, "_edsd_recorded", None) is not None:
        return
    drafter._edsd_recorded, drafter._edsd_recorded_caps = [], []
    original, runner = drafter.propose, worker.model_runner

    def propose(*args, **kwargs):
        # A tensor (V1 and V2), or one list per request (adaptive length, per-request caps).
        draft = original(*args, **kwargs)
        # V2's warm-up and padding runs draft nothing real; vLLM discards what is drafted after a
        # chunk of a prompt that is not its last
        if not kwargs.get("dummy_run", False) and not _prefilling(runner):
            drafter._edsd_recorded.append(draft if isinstance(draft, list) else draft.tolist())
            drafter._edsd_recorded_caps.append(_row_caps(runner, len(drafter._edsd_recorded[-1])))
        return draft

    drafter.propose = propose


def _prefilling(runner) -> bool:
    """Whether every request of the runner's step is a prompt still being prefilled in chunks
    (V1's ``discard_request_mask``; never on Model Runner V2, which has none)."""
    mask, batch = getattr(runner, "discard_request_mask", None), getattr(runner, "input_batch", None)
    return mask is not None and batch is not None and batch.num_reqs > 0 and bool(mask.np[: batch.num_reqs].all())


def _row_caps(runner, rows: int) -> list:
    """The ``num_speculative_tokens`` each row of the runner's batch asked for (None: none;
    all None on Model Runner V2, which has no V1 ``input_batch``)."""
    if not hasattr(runner, "input_batch"):
        return [None] * rows
    caps = []
    for req_id in runner.input_batch.req_ids:
        extra = runner.requests[req_id].sampling_params.extra_args or {}
        caps.append(extra.get("num_speculative_tokens"))
    return caps


def _install_forward_counter(worker) -> None:
    """Count the drafter model's forwards (each step's first and every later draft step)."""
    model = _drafter(worker).model
    if getattr(model, "_edsd_forwards", None) is not None:
        return
    model._edsd_forwards, original = 0, model.forward

    def forward(*args, **kwargs):
        model._edsd_forwards += 1
        return original(*args, **kwargs)

    model.forward = forward


def _take_forwards(worker) -> int:
    model = _drafter(worker).model
    forwards, model._edsd_forwards = model._edsd_forwards, 0
    return forwards


def _draft_sampler(worker) -> str:
    """What samples each draft step: the plugin's ``DraftVocabSampling`` where it hooked the
    proposer (serving/draft_vocab.py), else vLLM's own method (under the draft-length limiter,
    which wraps the draft step's sampler)."""
    from vllm_edsd.serving.features.draft_length import limiter_of

    return type(limiter_of(_drafter(worker))._sample).__name__


def _noise_rows(worker) -> list[str]:
    """The functions of vLLM's whose exponential noise this worker draws the plugin's way
    (serving/repairs/cpu_noise.py: on CPU only)."""
    from vllm_edsd.serving.patching import applied
    from vllm_edsd.serving.repairs.cpu_noise import DRAFT_NOISE, RECOVERED_TOKEN_NOISE

    return [row.attribute for row in (RECOVERED_TOKEN_NOISE, DRAFT_NOISE) if applied(row)]


def _take_recorded(worker) -> tuple[list, list]:
    drafter = _drafter(worker)
    recorded, drafter._edsd_recorded = drafter._edsd_recorded, []
    caps, drafter._edsd_recorded_caps = drafter._edsd_recorded_caps, []
    return recorded, caps


def draft_sources(llm) -> dict | None:
    """The prompt lookup's counts per draft source (lookup, drafter) on the first worker."""
    from vllm_edsd.serving.features.lookup import WORKER_METHOD

    return llm.collective_rpc(WORKER_METHOD)[0]


def difference(after: dict | None, before: dict | None) -> dict | None:
    """Per-source counts gained between two readings."""
    if after is None or before is None:
        return None
    return {source: {name: value - before[source][name] for name, value in counts.items()}
            for source, counts in after.items()}


def preemptions(llm) -> int:
    """How often the scheduler has preempted a request (its KV cache ran out) so far."""
    return sum(int(m.value) for m in llm.get_metrics() if m.name == "vllm:num_preemptions")


def prefix_cache(llm) -> dict[str, int]:
    """The prompt tokens looked up in the prefix cache so far, and those found there."""
    counts = {"queries": 0, "hits": 0}
    for metric in llm.get_metrics():
        key = {"vllm:prefix_cache_queries": "queries", "vllm:prefix_cache_hits": "hits"}.get(metric.name)
        if key:
            counts[key] += int(metric.value)
    return counts


def main(job_path: str, out_path: str) -> None:
    from vllm_edsd.launch.engine import make_llm

    job = json.loads(open(job_path).read())
    # The engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0): a second process
    # imports vLLM and the plugin again, about 15 s of every start on a 2-core CPU, and this
    # process is the engine's alone anyway. Servers, the bench and the demo keep vLLM's default,
    # the engine core in a process of its own.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    start = time.time()
    llm = make_llm(job["target"], job.get("speculative_config"), **job.get("llm_kwargs", {}))
    result = {"startup_s": time.time() - start, "phases": {}}
    spec = job.get("speculative_config")
    if spec:
        result["noise_rows"] = llm.collective_rpc(_noise_rows)  # one per rank
        if spec["method"] in ("edsd", "eagle3"):
            result["draft_samplers"] = llm.collective_rpc(_draft_sampler)  # one per rank
    for phase in job["phases"]:
        result["phases"][phase["name"]] = run_phase(llm, phase)
    with open(out_path, "w") as f:
        json.dump(result, f)


def run_phase(llm, phase: dict) -> dict:
    """One phase's prompts through ``llm``: the outputs, and what the phase asked to record of them."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_edsd.launch.engine import spec_counters

    # One SamplingParams for the phase, or one per prompt (a list).
    sampling = phase["sampling"]
    params = [SamplingParams(**s) for s in sampling] if isinstance(sampling, list) else SamplingParams(**sampling)
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in phase["prompts"]]
    record, record_batch = phase.get("record_proposals", False), phase.get("record_batch", False)
    if record or record_batch:
        llm.collective_rpc(_install_recorder)
    count_forwards = phase.get("count_drafter_forwards", False)
    if count_forwards:
        llm.collective_rpc(_install_forward_counter)
        llm.collective_rpc(_take_forwards)
    before, preempted_before, cache_before = spec_counters(llm), preemptions(llm), prefix_cache(llm)
    sources_before = draft_sources(llm) if phase.get("draft_sources") else None
    outputs, proposals, batch_steps, request_metrics, cached, forwards = [], [], [], [], [], []
    # Recorded proposals are attributed to a prompt by running prompts one at a time
    # (``record_batch``: the whole batch at once, each step's rows with their caps).
    one_at_a_time = record or phase.get("one_at_a_time", False)
    groups = [([p], [params[i]] if isinstance(params, list) else params) for i, p in enumerate(prompts)] \
        if one_at_a_time else [(prompts, params)]
    for group, group_params in groups:
        for output in llm.generate(group, group_params, use_tqdm=False):
            outputs.append(list(output.outputs[0].token_ids))
            cached.append(getattr(output, "num_cached_tokens", None))  # prompt tokens the prefix cache held
            # vLLM's per-request spec-decode metrics, where it has them and they are on.
            metrics = getattr(output.outputs[0], "spec_decode_metrics", None)
            request_metrics.append(None if metrics is None else metrics.to_dict())
        if record:
            proposals.append(llm.collective_rpc(_take_recorded)[0][0])
        if count_forwards:  # per group: per request where they run one at a time
            forwards.append(llm.collective_rpc(_take_forwards)[0])
    if record_batch:
        drafts, caps = llm.collective_rpc(_take_recorded)[0]
        batch_steps = [list(zip(c, d, strict=True)) for c, d in zip(caps, drafts, strict=True)]
    return {
        "outputs": outputs,
        "counters": (spec_counters(llm) - before).as_dict(),
        "proposals": proposals,
        "batch_steps": batch_steps,
        "request_metrics": request_metrics,
        "preemptions": preemptions(llm) - preempted_before,
        "draft_sources": difference(draft_sources(llm), sources_before) if sources_before else None,
        "cached_tokens": cached,
        "drafter_forwards": forwards,
        "prefix_cache": {key: value - cache_before[key] for key, value in prefix_cache(llm).items()},
    }


def serve_forks() -> None:
    """Import vLLM once, then run every job named on stdin (a JSON line: job, out and log paths)
    in a child forked from this process. Importing vLLM took 11-15 s of every engine job on a
    2-core AMD EPYC with AVX2 only, about 4 times the toy engine's own start; a fork starts with
    it imported. For each job this prints the child's pid, then its exit status (negative: the
    signal that killed it), one JSON line each on its stdout (what imported code prints goes to
    stderr). The child writes to its log alone and ends as a process of its own does (atexit
    handlers and finalisers run), so its log is what the job would print in a fresh process.
    End of stdin ends the server."""
    replies = os.fdopen(os.dup(1), "w")  # the replies' own pipe: vLLM 0.27 logs to stdout
    os.dup2(2, 1)
    import vllm  # noqa: F401  (what every fork saves)
    from vllm import SamplingParams  # noqa: F401

    import vllm_edsd.launch.engine  # noqa: F401

    for line in sys.stdin:
        job_path, out_path, log_path = json.loads(line)
        pid = os.fork()
        if pid == 0:
            replies.close()
            _run_forked(job_path, out_path, log_path)
        print(json.dumps(pid), file=replies, flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps(os.waitstatus_to_exitcode(status)), file=replies, flush=True)


def _run_forked(job_path: str, out_path: str, log_path: str) -> None:
    """The child: stdout and stderr to the job's log, then ``main``; leaves by SystemExit."""
    sys.stdin.close()
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    faulthandler.enable()
    main(job_path, out_path)
    raise SystemExit(0)


if __name__ == "__main__":
    # An engine killed by a signal (SIGSEGV, SIGILL) writes the Python frames it died in to its
    # log, which the failing test prints.
    if sys.argv[1:] == ["--forks"]:
        serve_forks()
    else:
        faulthandler.enable()
        main(sys.argv[1], sys.argv[2])
