"""Helpers for the workbench tests (waiting on a pilot, reading toasts and widget text)."""

import asyncio


async def wait_for(pilot, predicate, timeout: float = 30.0, what: str = "condition") -> None:
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
