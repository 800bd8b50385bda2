"""Helpers for the workbench tests (waiting on a pilot, reading toasts and widget text)."""

import asyncio

#: a ceiling, not a measure: a loaded 2-core machine may be 40x slower than a quiet one, and no test may
#: fail for that; a test that hangs for real still ends with a message naming what it waited for
CEILING_SECONDS = 600.0


async def wait_for(pilot, predicate, timeout: float = CEILING_SECONDS, what: str = "condition") -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not predicate():
        if loop.time() > end:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await pilot.pause(0.05)


def notes(app) -> list[str]:
    """Messages of the toasts the app has shown (and not yet expired)."""
    return [n.message for n in app._notifications]


def plain(widget) -> str:
    rendered = widget.render()
    return getattr(rendered, "plain", str(rendered))
