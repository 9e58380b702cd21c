"""Serving EDSD drafters in vLLM: the plugin that adds ``"method": "edsd"`` (``plugin``), the
draft model vLLM runs (``vllm_model``), the entropy-adaptive draft length (``adaptive``), and
the engine and OpenAI-server helpers the demo, the bench and the tests share (``engine``,
``server``)."""
