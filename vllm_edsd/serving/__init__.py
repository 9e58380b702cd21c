"""Serving EDSD drafters in vLLM: the plugin that adds ``"method": "edsd"`` and lists every change
it makes to vLLM (``plugin``, ``patching``, ``cpu_sampling``), the draft model vLLM runs
(``vllm_model``) and a request's draft length (``draft_length``). Engines and servers are
started by ``vllm_edsd.launch``."""
