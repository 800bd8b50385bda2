"""Workbench tests: Textual pilots on the tiny model, with sessions in a temporary data dir."""

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


@pytest.fixture(scope="session")
def words_engine(request, tmp_path_factory):
    """The snapshot model (tests/tui/words_model.py): SmolLM2's tokenizer and KV geometry, random weights whose
    greedy text is English words; fixed load time and thread count so screens render the same every time.
    The tokenizer is kept in pytest's cache (a run with ``-p no:cacheprovider`` writes it in this run's tmp)."""
    from tests.tui.words_model import smollm2_tokenizer, words_model
    from tqbench.engine.engine import Engine

    cache = getattr(request.config, "cache", None)
    root = cache.mkdir("tqbench") if cache is not None else tmp_path_factory.mktemp("tqbench")
    tokenizer = smollm2_tokenizer(root)
    return Engine(dataclasses.replace(words_model(tokenizer), load_seconds=1.0, threads=1))
