"""Serving EDSD drafters in vLLM: the plugin that adds ``"method": "edsd"`` and lists every vLLM
attribute it replaces (``plugin``, ``patching``, ``cpu_sampling``), the draft model vLLM runs
(``vllm_model``) and the entropy-adaptive draft length (``adaptive``). Engines and servers are
started by ``vllm_edsd.launch``."""
