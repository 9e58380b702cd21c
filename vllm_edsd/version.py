"""The package version, in a module of its own so that any room can read it."""

__version__ = "0.1.0"
