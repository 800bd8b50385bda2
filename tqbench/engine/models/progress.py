"""Progress messages: the engine never prints, it calls an optional ``on_progress(message)``."""

from __future__ import annotations

from collections.abc import Callable

ProgressFn = Callable[[str], None]


def notify(on_progress: ProgressFn | None, message: str) -> None:
    if on_progress is not None:
        on_progress(message)
