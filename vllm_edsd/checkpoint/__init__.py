"""Drafter checkpoint formats: the configuration (``config``), the weight files (``files``) and
the layouts drafters come in (``layouts``: this project's, SpecForge's, vLLM's, EAGLE-3's)."""
