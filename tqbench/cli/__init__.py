"""The command line: ``tqbench`` (the workbench), ``tqbench --headless <command>`` and ``tqbench serve``.

``group`` holds the click group and the generation commands; one module per command family beside it;
``render/`` turns engine results into rich tables and Markdown. Nothing here imports torch at import time.
"""

from tqbench.cli.group import main

__all__ = ["main"]
