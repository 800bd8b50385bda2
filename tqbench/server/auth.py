"""Bearer-key authentication for ``/v1`` and the tokenizer routes (``tqbench serve --api-key``)."""

from __future__ import annotations

import secrets

from fastapi.responses import JSONResponse

from tqbench.server.errors import error_body

TOKENIZER_PATHS = ("/tokenizer_info", "/tokenize", "/detokenize")  # vLLM's, which lm-eval's remote tokenizer reads


class BearerAuth:
    """ASGI middleware: with an API key, every ``/v1`` request needs ``Authorization: Bearer <key>``."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.api_key = api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and (scope["path"].startswith("/v1") or scope["path"] in TOKENIZER_PATHS):
            headers = dict(scope.get("headers") or [])
            auth = headers.get(b"authorization", b"")
            scheme, _, token = auth.partition(b" ")
            if not auth:
                message = "missing API key: send the header 'Authorization: Bearer <key>' (the --api-key value)"
            elif scheme.lower() != b"bearer" or not secrets.compare_digest(token.strip(), self.api_key):
                message = "invalid API key: send 'Authorization: Bearer <key>' with the server's --api-key value"
            else:
                message = None
            if message is not None:
                response = JSONResponse(error_body(message, "authentication_error", None, "invalid_api_key"),
                                        status_code=401, headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
