"""Serving EDSD drafters in vLLM: the plugin that adds ``"method": "edsd"``.

The core: ``plugin`` (``install``: the registrations with vLLM's model and speculators
registries, then the patches), ``request`` (an ``"edsd"`` speculative config checked and handed
to vLLM as its EAGLE-3), ``preflight`` (where the models are), ``hooks`` (the replacements that
put the features into vLLM's engine), ``patches`` (the one table of every change to vLLM) and
``patching`` (how a change is made), ``versions``, ``user_errors`` and ``vllm_names`` (every vLLM
name the plugin depends on). Apart from it: ``repairs/``, what vLLM's CPU build gets wrong,
and ``features/``, what the plugin adds beyond the paper (a request's draft length, prompt
lookup beside the drafter). The draft model vLLM runs is ``methods/edsd/vllm_model.py``;
engines and servers are started by ``vllm_edsd.launch``."""
