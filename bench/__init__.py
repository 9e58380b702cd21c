"""The paper's measurements for no speculation, vLLM's EAGLE-3 and EDSD: ``python -m bench``."""
