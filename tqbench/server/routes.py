"""The endpoints, one router per family; each reads the ``Server`` it is given (``app.create_app`` wires them).

- ``ops_routes``: ``/health`` and ``/metrics`` (for load balancers and Prometheus);
- ``tokenizer_routes``: ``/tokenizer_info``, ``/tokenize``, ``/detokenize`` (vLLM's names);
- ``model_routes``: ``/v1/models``, ``/v1/kv_policies``, ``/v1/last_cache_report``;
- ``completion_routes``: ``/v1/chat/completions`` and ``/v1/completions`` (``RequestRunner.handle``).
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from tqbench.engine import PRESETS
from tqbench.server.metrics import prometheus_text
from tqbench.server.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from tqbench.server.server import Server


def ops_routes(server: Server) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health():
        body = server.health()
        return JSONResponse(body, status_code=200 if body["status"] == "ok" else 503)

    @router.get("/metrics")
    async def metrics():
        return PlainTextResponse(prometheus_text(server), media_type="text/plain; version=0.0.4; charset=utf-8")

    return router


def tokenizer_routes(server: Server) -> APIRouter:
    router = APIRouter()

    @router.get("/tokenizer_info")
    async def tokenizer_info():
        return server.tokenizer_info()

    @router.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        return server.tokenize(req)

    @router.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        return server.detokenize(req)

    return router


def model_routes(server: Server) -> APIRouter:
    router = APIRouter()

    @router.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(server)]}

    @router.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        server.check_model(model_id)
        return model_card(server)

    @router.get("/v1/kv_policies")
    async def kv_policies():
        return {"object": "list", "default": server.policy.label, "presets": sorted(PRESETS)}

    @router.get("/v1/last_cache_report")
    async def last_cache_report():
        return server.last_report()

    return router


def completion_routes(server: Server) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        return await server.handle(request, req, chat=True)

    @router.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        return await server.handle(request, req, chat=False)

    return router


def model_card(server: Server) -> dict:
    return {"id": server.model_id, "object": "model", "created": server.started, "owned_by": "tqbench",
            "kv_policy": server.policy.label, "cache_mode": server.cache_mode,
            "max_context": server.engine.max_context}


ROUTERS = (ops_routes, tokenizer_routes, model_routes, completion_routes)
