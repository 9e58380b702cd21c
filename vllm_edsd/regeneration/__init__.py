"""Regeneration (``edsd regenerate``, ``--regenerate``): the target answers the training prompts
itself (``answers``), through vLLM or transformers (``greedy``)."""
