"""The ASGI app: ``create_app(engine, ...)`` gives a FastAPI app (tests run it under a real uvicorn)."""

from __future__ import annotations

import contextlib

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from tqbench import __version__
from tqbench.engine import PRESETS, Policy
from tqbench.server.admission import KVBudget
from tqbench.server.auth import BearerAuth
from tqbench.server.errors import install_error_handlers
from tqbench.server.metrics import prometheus_text
from tqbench.server.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from tqbench.server.server import Server
from tqbench.server.worker import DEFAULT_MAX_BATCH

__all__ = ["Server", "create_app"]


def create_app(engine, *, kv_policy: str | Policy = "turbo4", cache_mode: str = "compressed",
               max_new_tokens: int = 256, max_queue: int = 8, api_key: str | None = None,
               model_aliases: tuple[str, ...] = (), max_batch: int = DEFAULT_MAX_BATCH,
               prefill_chunk: int = 0, kv_budget: KVBudget | str | int | None = None) -> FastAPI:
    """A FastAPI app serving ``engine``; the worker thread starts and stops with the app's lifespan."""
    server = Server(engine, kv_policy=kv_policy, cache_mode=cache_mode, max_new_tokens=max_new_tokens,
                    max_queue=max_queue, model_aliases=model_aliases, max_batch=max_batch,
                    prefill_chunk=prefill_chunk, kv_budget=kv_budget)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        server.worker.start()
        try:
            yield
        finally:
            server.worker.stop()

    app = FastAPI(title="tqbench serve", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = server
    install_error_handlers(app)
    if api_key:
        app.add_middleware(BearerAuth, api_key=api_key)

    @app.get("/health")
    async def health():
        body = server.health()
        return JSONResponse(body, status_code=200 if body["status"] == "ok" else 503)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(prometheus_text(server), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return server.tokenizer_info()

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        return server.tokenize(req)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        return server.detokenize(req)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_card(server)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        server.check_model(model_id)
        return _model_card(server)

    @app.get("/v1/kv_policies")
    async def kv_policies():
        return {"object": "list", "default": server.policy.label, "presets": sorted(PRESETS)}

    @app.get("/v1/last_cache_report")
    async def last_cache_report():
        return server.last_report()

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        return await server.handle(request, req, chat=True)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        return await server.handle(request, req, chat=False)

    return app


def _model_card(server: Server) -> dict:
    return {"id": server.model_id, "object": "model", "created": server.started, "owned_by": "tqbench",
            "kv_policy": server.policy.label, "cache_mode": server.cache_mode,
            "max_context": server.engine.max_context}
