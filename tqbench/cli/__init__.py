"""The command line: ``tqbench`` (the workbench), ``tqbench --headless <command>`` and ``tqbench serve``.

``group`` holds the click group; one module per command family beside it registers on it (``bench``,
``validate``, ``compare``, ``scan``, ``estimate``, ``serve``; ``workbench`` opens the TUI), ``options`` holds
what they share, and ``render/`` turns engine results (typed dataclasses) into rich tables and Markdown.
Nothing here imports torch at import time.
"""

from tqbench.cli.group import main

__all__ = ["main"]
