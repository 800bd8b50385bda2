"""OpenAI-compatible HTTP server on the engine (``tqbench serve``)."""

from tqbench.server.app import create_app

__all__ = ["create_app"]
