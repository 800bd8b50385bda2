"""The Textual workbench: the only place textual is imported (``tqbench`` with no subcommand opens it)."""
