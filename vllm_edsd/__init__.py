"""vllm-edsd: serve and train EDSD speculative-decoding drafters in vLLM.

``register`` is the ``vllm.general_plugins`` entry point. vLLM calls it in every process
(front end, engine core, each worker), so it is idempotent and imports nothing heavy
until vLLM itself is being configured.
"""

from vllm_edsd.version import __version__

__all__ = ["__version__", "register"]


def register() -> None:
    """Register the EDSD draft model with vLLM and accept ``"method": "edsd"``."""
    from vllm_edsd.serving.plugin import install

    install()
