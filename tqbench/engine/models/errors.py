"""What goes wrong finding or loading a model: the message says why and what to do."""

from __future__ import annotations


class ModelLoadError(Exception):
    """A model could not be loaded; the message says why and what to do."""


class ModelNotFoundError(ModelLoadError):
    """The requested model (or the default model's GGUF file) is not where it should be."""
