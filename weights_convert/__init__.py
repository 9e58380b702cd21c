"""Convert EDSD training checkpoints to the layout the vLLM plugin serves."""

from .converter import Summary, convert

__all__ = ["Summary", "convert"]
