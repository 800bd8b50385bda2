"""Server tests: a real uvicorn server on a free loopback port, serving the tiny model."""

from __future__ import annotations

import pytest
from serverkit import LiveServer


@pytest.fixture(scope="module")
def live_server(tiny_engine):
    """The tiny model behind a roomy queue (module scope: one uvicorn per test file)."""
    import torch

    from tqbench.server import create_app

    torch.set_num_threads(1)
    app = create_app(tiny_engine, kv_policy="turbo4", max_new_tokens=512, max_queue=16, model_aliases=("tiny",))
    with LiveServer(app) as live:
        yield live
