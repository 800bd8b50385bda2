"""Workbench tests: Textual pilots on the tiny model, with sessions in a temporary data dir."""

import asyncio
import dataclasses

import pytest


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture
def data_dir(tmp_path, monkeypatch):
    d = tmp_path / "data"
    monkeypatch.setenv("TQBENCH_DATA_DIR", str(d))
    return d / "sessions"


@pytest.fixture(scope="session")
def steady_engine(tiny_engine):
    """The tiny engine with a fixed load time and thread count, so screens render the same every time."""
    from tqbench.engine.engine import Engine

    return Engine(dataclasses.replace(tiny_engine.loaded, load_seconds=1.0, threads=1))


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
