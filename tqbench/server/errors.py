"""Every error the server sends has the OpenAI shape: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

# What to send instead, for the pydantic error types a client hits most.
_HINTS = {
    "missing": "add it to the request",
    "float_parsing": "send a number",
    "float_type": "send a number",
    "int_parsing": "send an integer",
    "int_type": "send an integer",
    "int_from_float": "send an integer",
    "bool_parsing": "send true or false",
    "bool_type": "send true or false",
    "string_type": "send a string",
    "list_type": "send a JSON array",
    "dict_type": "send a JSON object",
    "model_type": "send a JSON object",
    "extra_forbidden": "remove this field (tqbench serve does not support it)",
}


class APIError(Exception):
    """A request tqbench cannot serve, with what the client should change."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type_: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_ or _default_type(status)
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def _default_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 404:
        return "not_found_error"
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def validation_message(errors: list[dict], content_type: str = "application/json") -> tuple[int, str, str | None, str]:
    """(status, message, param, code) for a pydantic / FastAPI validation failure."""
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if not loc and "json" not in content_type.lower():
        return 400, (f"the request body must be JSON sent with 'Content-Type: application/json' (got "
                     f"{content_type or 'no Content-Type'})"), None, "invalid_json"
    if not loc and first.get("type") == "missing":
        return 400, "the request body is empty: send a JSON object", None, "invalid_json"
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx") or {}
        detail = ctx.get("error") or first.get("msg", "")
        return 400, f"the request body is not valid JSON ({detail}): send a JSON object", None, "invalid_json"
    if not loc and first.get("type") in ("model_attributes_type", "dict_type", "model_type"):
        return 400, "the request body must be a JSON object", None, "invalid_json"
    # Union members add their type name to the location ("messages.0.content.str"); drop those.
    loc = [p for p in loc if p not in ("str", "list[str]", "list[int]", "list[list[int]]", "int", "list[ChatContentPart]")]
    param = ".".join(loc) if loc else None
    hint = _HINTS.get(first.get("type", ""), "")
    msg = first.get("msg", "invalid value")
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    where = f"{param}: " if param else ""
    text = f"{where}{msg}" + (f" ({hint})" if hint and hint not in msg else "")
    extra = f"; and {len(errors) - 1} more problem(s)" if len(errors) > 1 else ""
    return 422, text + extra, param, "invalid_value" if first.get("type") != "missing" else "missing_field"


def _counted(request: Request, response: JSONResponse) -> JSONResponse:
    """Count the error response by status on the server (``/metrics``: ``tqbench_error_responses_total``)."""
    counts = getattr(getattr(request.app.state, "server", None), "error_responses", None)
    if counts is not None:
        counts[response.status_code] = counts.get(response.status_code, 0) + 1
    return response


def install_error_handlers(app) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return _counted(request, error_response(exc))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        status, message, param, code = validation_message(list(exc.errors()),
                                                          request.headers.get("content-type", ""))
        return _counted(request, JSONResponse(error_body(message, "invalid_request_error", param, code),
                                              status_code=status))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}: see GET /v1/models, POST /v1/chat/completions"
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        return _counted(request, JSONResponse(error_body(message, _default_type(exc.status_code), None, None),
                                              status_code=exc.status_code, headers=getattr(exc, "headers", None)))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        message = f"internal error: {type(exc).__name__}: {exc}".splitlines()[0]
        return _counted(request, JSONResponse(error_body(message, "server_error", None, "internal_error"),
                                              status_code=500))
