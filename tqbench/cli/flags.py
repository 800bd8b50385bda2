"""The CLI names its own flags: an engine ``RequestError`` names a field (``seq_len``), the CLI spells it as the
running command's flag (``--seq-len``). Torch-free."""

from __future__ import annotations

import click

#: engine fields whose flag has another name (click parameter names, first one the command has wins)
ALIASES: dict[str, tuple[str, ...]] = {
    "policies": ("kv_policy",),
    "context_tokens": ("tf_context",),
    "eval_tokens": ("tf_tokens",),
    "partial_path": ("resume",),
    "out": ("out_path",),
    "tasks": ("task_names",),
}


def flag_for(field: str) -> str:
    """The running command's flag for the engine field ``field`` (the field itself when it has none)."""
    ctx = click.get_current_context(silent=True)
    options = {p.name: p for p in ctx.command.params if isinstance(p, click.Option)} if ctx else {}
    for name in (field, *ALIASES.get(field, ())):
        if name in options:
            return max(options[name].opts, key=len)
    return field


def spelled(exc: ValueError) -> str:
    """``exc``'s message, a ``RequestError`` with its field spelled as this command's flag."""
    from tqbench.engine.request import RequestError

    return exc.spelled(flag_for(exc.field)) if isinstance(exc, RequestError) else str(exc)
