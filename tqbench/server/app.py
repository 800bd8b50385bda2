"""The ASGI app: ``create_app(engine, ...)`` gives a FastAPI app (tests run it under a real uvicorn).

Start-up and wiring only: the ``Server`` (state, checks, running requests: ``server.py``), the worker thread's
lifespan, the error handlers, the optional bearer key, and the endpoint families (``routes.py``).
"""

from __future__ import annotations

import contextlib

from fastapi import FastAPI

from tqbench import __version__
from tqbench.engine import Policy
from tqbench.server.admission import KVBudget
from tqbench.server.auth import BearerAuth
from tqbench.server.errors import install_error_handlers
from tqbench.server.prefix import DEFAULT_PREFIX_CACHE
from tqbench.server.routes import ROUTERS
from tqbench.server.server import Server
from tqbench.server.worker import DEFAULT_MAX_BATCH

__all__ = ["Server", "create_app"]


def create_app(engine, *, kv_policy: str | Policy = "turbo4", cache_mode: str = "compressed",
               max_new_tokens: int = 256, max_queue: int = 8, api_key: str | None = None,
               model_aliases: tuple[str, ...] = (), max_batch: int = DEFAULT_MAX_BATCH,
               prefill_chunk: int = 0, kv_budget: KVBudget | str | int | None = None,
               prefix_cache: str | int | None = DEFAULT_PREFIX_CACHE) -> FastAPI:
    """A FastAPI app serving ``engine``; the worker thread starts and stops with the app's lifespan.
    ``prefix_cache``: the byte cap of compressed shared prefixes (``server.prefix``; 0: off)."""
    server = Server(engine, kv_policy=kv_policy, cache_mode=cache_mode, max_new_tokens=max_new_tokens,
                    max_queue=max_queue, model_aliases=model_aliases, max_batch=max_batch,
                    prefill_chunk=prefill_chunk, kv_budget=kv_budget, prefix_cache=prefix_cache)
    app = FastAPI(title="tqbench serve", version=__version__, lifespan=_lifespan(server), docs_url=None,
                  redoc_url=None)
    app.state.server = server
    install_error_handlers(app)
    if api_key:
        app.add_middleware(BearerAuth, api_key=api_key)
    for routes in ROUTERS:
        app.include_router(routes(server))
    return app


def _lifespan(server: Server):
    """The worker thread runs while the app does."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        server.worker.start()
        try:
            yield
        finally:
            server.worker.stop()

    return lifespan
