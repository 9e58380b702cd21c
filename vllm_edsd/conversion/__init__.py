"""EDSD drafters as they exist in the wild (this project's training layout, SpecForge's) to the
layout vLLM serves (``converter``; ``edsd convert``: ``cli``). ``weights_convert/`` is the
top-level entry to the same code."""
