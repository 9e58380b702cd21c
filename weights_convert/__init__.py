"""Convert EDSD drafters (this project's training layout, SpecForge's) to the layout the vLLM plugin serves."""

from vllm_edsd.conversion.converter import Summary, convert

__all__ = ["Summary", "convert"]
