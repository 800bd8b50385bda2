"""The ASGI app: ``create_app(engine, ...)`` gives a FastAPI app (tests run it under a real uvicorn)."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from tqbench import __version__
from tqbench.engine import PRESETS, Policy, PromptTooLongError, Sampling, parse_policy
from tqbench.engine.cache import check_mode
from tqbench.engine.events import GenerationFinished, GenerationStarted, PromptScored, TokenGenerated
from tqbench.server.errors import APIError, error_body, install_error_handlers
from tqbench.server.metrics import prometheus_text
from tqbench.server.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    chat_messages,
    completion_prompt,
)
from tqbench.server.stream import (
    ChunkWriter,
    StopTrimmer,
    TokenTexts,
    cache_report_body,
    chat_logprobs,
    completion_logprobs,
    extension,
    full_response,
    new_id,
)
from tqbench.server.worker import (
    DEFAULT_MAX_BATCH,
    END,
    Job,
    JobFailed,
    JobStarted,
    QueueFull,
    ShuttingDown,
    Worker,
)

MAX_TEMPERATURE = 2.0
POLL_SECONDS = 0.2


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


class Server:
    """Validates requests, queues them on the worker and turns engine events into OpenAI responses."""

    def __init__(self, engine, *, kv_policy: str | Policy, cache_mode: str, max_new_tokens: int,
                 max_queue: int, model_aliases: tuple[str, ...] = (), max_batch: int = DEFAULT_MAX_BATCH,
                 prefill_chunk: int = 0) -> None:
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens} is invalid: allow at least 1 token")
        if prefill_chunk < 0:
            raise ValueError(f"prefill_chunk={prefill_chunk} is invalid: use 0 (the whole prompt in one forward "
                             "call) or a positive number of tokens per call")
        self.prefill_chunk = prefill_chunk
        self.texts = TokenTexts(engine.tokenizer)
        self.engine = engine
        self.policy = parse_policy(kv_policy)
        self.cache_mode = check_mode(cache_mode)
        self.max_new_tokens = max_new_tokens
        self.model_id = engine.name
        self.model_names = {engine.name, *[a for a in model_aliases if a]}
        geometry = engine.geometry
        self._num_layers = geometry.num_layers
        self._layer_types = list(geometry.layer_types) if geometry.layer_types else None
        self.policy.plan(self._num_layers, self._layer_types)
        if self.cache_mode == "fused":
            engine.enable_fused()
        self.worker = Worker(engine, max_queue, max_batch)
        self.started = int(time.time())
        self.last: tuple[str, int, object] | None = None  # (response id, created, result) of the last finish

    # -- request checks -----------------------------------------------------------------------------
    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.model_names:
            raise APIError(404, f"model {name!r} is not served here: this server runs {self.model_id!r} "
                           "(see GET /v1/models)", param="model", code="model_not_found")

    def request_policy(self, text: str | None) -> Policy:
        if text is None:
            return self.policy
        if "/" in text or "\\" in text or text.strip().endswith((".json", ".toml")):
            raise APIError(400, f"kv_policy={text!r} looks like a file path; the server does not read files "
                           "for clients: send a preset name or a compact policy such as 'k=turbo4,v=turbo4'",
                           param="kv_policy", code="invalid_kv_policy")
        try:
            policy = parse_policy(text)
            policy.plan(self._num_layers, self._layer_types)
        except ValueError as exc:
            raise APIError(400, f"kv_policy={text!r} is invalid: {exc} (GET /v1/kv_policies lists the presets)",
                           param="kv_policy", code="invalid_kv_policy") from None
        return policy

    def sampling(self, req) -> tuple[Sampling, int | None]:
        temperature = 0.0 if req.temperature is None else req.temperature
        top_p = 1.0 if req.top_p is None else req.top_p
        if not 0 <= temperature <= MAX_TEMPERATURE:
            raise APIError(400, f"temperature={temperature} is invalid: use a number from 0 (greedy) to "
                           f"{MAX_TEMPERATURE:g}", param="temperature", code="invalid_value")
        if not 0 < top_p <= 1:
            raise APIError(400, f"top_p={top_p} is invalid: use a number in (0, 1]", param="top_p",
                           code="invalid_value")
        seed = req.seed
        if temperature > 0 and seed is None:
            seed = secrets.randbelow(2**31)
        return Sampling(temperature=temperature, top_p=top_p, seed=seed or 0), seed

    def token_budget(self, req, allow_zero: bool = False) -> tuple[int | None, str]:
        if req.max_completion_tokens is not None:
            value, param = req.max_completion_tokens, "max_completion_tokens"
        else:
            value, param = req.max_tokens, "max_tokens"
        if value is None:
            return None, param
        if value < 0 or (value == 0 and not allow_zero):
            more = " (0 is allowed with echo=true: score the prompt only)" if value == 0 else ""
            raise APIError(400, f"{param}={value} is invalid: ask for at least 1 token{more}", param=param,
                           code="invalid_value")
        if value > self.max_new_tokens:
            raise APIError(400, f"{param}={value} is above this server's cap of {self.max_new_tokens} tokens "
                           f"(tqbench serve --max-new-tokens): ask for at most {self.max_new_tokens}",
                           param=param, code="invalid_value")
        return value, param

    def encode(self, prompt, chat: bool, budget: int | None, param: str):
        limit = self.engine.max_context
        try:
            ids = self.prompt_ids(prompt) if isinstance(prompt, list) and not chat else \
                self.engine.encode_prompt(prompt, chat=chat, max_new_tokens=0)
            if limit and ids.shape[1] > limit:
                raise PromptTooLongError(f"{ids.shape[1]} tokens")
        except PromptTooLongError:
            raise APIError(400, f"the prompt is longer than {self.model_id}'s context of {limit} tokens: "
                           "shorten it", param="messages" if chat else "prompt",
                           code="context_length_exceeded") from None
        except APIError:
            raise
        except Exception as exc:  # e.g. a chat template that refuses a role order
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise APIError(400, f"the prompt could not be encoded: {first}",
                           param="messages" if chat else "prompt", code="invalid_prompt") from None
        n = ids.shape[1]
        if budget is None:
            budget = self.max_new_tokens if not limit else min(self.max_new_tokens, limit - n)
            if budget < 1:
                raise APIError(400, f"the prompt has {n} tokens and fills {self.model_id}'s context of {limit} "
                               "tokens: shorten it", param="messages" if chat else "prompt",
                               code="context_length_exceeded")
        elif limit and n + budget > limit:
            raise APIError(400, f"the prompt has {n} tokens and {param}={budget} more were asked for, but "
                           f"{self.model_id} has a context of {limit} tokens: shorten the prompt or lower "
                           f"{param} to at most {max(0, limit - n)}", param=param,
                           code="context_length_exceeded")
        return ids, budget

    def prompt_ids(self, ids: list[int]):
        """A ``[1, T]`` tensor of client-sent token ids, each checked against the vocabulary."""
        import torch

        vocab = len(self.engine.tokenizer)
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"prompt has token id {bad[0]}, outside {self.model_id}'s vocabulary of {vocab} "
                           f"tokens (ids 0-{vocab - 1}): tokenize with this model's tokenizer (POST /tokenize)",
                           param="prompt", code="invalid_value")
        return torch.tensor([ids], dtype=torch.long)

    # -- running a request --------------------------------------------------------------------------
    async def handle(self, request: Request, req, chat: bool):
        req.check_supported()
        self.check_model(req.model)
        prompt = chat_messages(req) if chat else completion_prompt(req)
        stop = req.stop_list()
        top, echo = req.logprob_options(chat)
        budget, param = self.token_budget(req, allow_zero=echo)
        sampling, seed = self.sampling(req)
        policy = self.request_policy(req.kv_policy)
        detail = req.report_detail()
        ids, budget = self.encode(prompt, chat, budget, param)
        job = Job(ids, policy, self.cache_mode, budget, sampling, stop, not req.ignore_eos,
                  asyncio.get_running_loop(), logprobs=top, echo=echo, prefill_chunk=self.prefill_chunk)
        try:
            self.worker.submit(job)
        except QueueFull as full:
            raise APIError(429, f"the server is busy: {self.worker.max_queue} requests are already waiting "
                           f"(tqbench serve --max-queue); retry after {full.retry_after}s",
                           code="queue_full", headers={"Retry-After": str(full.retry_after)}) from None
        except ShuttingDown:
            raise APIError(503, "the server is shutting down: send the request to another server or retry later",
                           code="shutting_down") from None
        try:
            waited, head = await self._until_started(job, request)
        except BaseException:
            job.cancelled.set()
            raise
        if head is None:  # the client left while the request waited, or the server is shutting down
            if self.worker.closing:
                raise APIError(503, "the server is shutting down: retry later", code="shutting_down")
            return JSONResponse(error_body("client disconnected", "invalid_request_error"), status_code=499)
        if req.stream:
            writer = ChunkWriter(chat=chat, model=self.model_id, include_usage=req.include_usage)
            return StreamingResponse(self._sse(job, writer, stop, seed, waited, detail),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        echo_text = None
        if echo:
            echo_text = prompt if isinstance(prompt, str) else self.engine.tokenizer.decode(prompt)
        return await self._collect(job, request, chat, stop, seed, waited, detail, top, echo_text)

    async def _next(self, job: Job, request: Request | None):
        """The job's next event; with ``request``, poll for a client disconnect meanwhile (cancels the job)."""
        if request is None:
            return await job.events.get()
        getter = asyncio.ensure_future(job.events.get())
        try:
            while True:
                done, _ = await asyncio.wait({getter}, timeout=POLL_SECONDS)
                if done:
                    return getter.result()
                if not job.cancelled.is_set() and await request.is_disconnected():
                    job.cancelled.set()
        finally:
            if not getter.done():
                getter.cancel()

    async def _until_started(self, job: Job, request: Request):
        """Wait in the queue until the engine has accepted the job (``GenerationStarted``)."""
        waited = 0.0
        while True:
            item = await self._next(job, request)
            if item is END:
                return waited, None
            if isinstance(item, JobStarted):
                waited = item.waited_seconds
            elif isinstance(item, GenerationStarted):
                return waited, item
            elif isinstance(item, JobFailed):
                await self._drain(job)
                raise _engine_error(item.error)

    @staticmethod
    async def _drain(job: Job) -> None:
        while await job.events.get() is not END:
            pass

    async def _collect(self, job: Job, request: Request, chat: bool, stop, seed, waited: float, detail: str,
                       top: int | None = None, echo_text: str | None = None):
        trimmer = StopTrimmer(stop)
        result = None
        failure = None
        scored = None
        generated = []
        while True:
            item = await self._next(job, request)
            if item is END:
                break
            if isinstance(item, TokenGenerated):
                trimmer.push(item.text_delta)
                if item.logprob is not None:
                    generated.append(item.logprob)
            elif isinstance(item, PromptScored):
                scored = item
            elif isinstance(item, GenerationFinished):
                result = item.result
            elif isinstance(item, JobFailed):
                failure = item.error
        if failure is not None or result is None:
            raise _engine_error(failure or RuntimeError("the generation ended without a result"))
        rid, created = new_id(chat), int(time.time())
        self.last = (rid, created, result)
        logprobs = None
        if top is not None:
            logprobs = chat_logprobs(generated, self.texts) if chat else completion_logprobs(generated, self.texts, scored)
        text = trimmer.final_text if echo_text is None else echo_text + trimmer.final_text
        body = full_response(chat=chat, rid=rid, model=self.model_id, created=created, text=text,
                             result=result, ext=extension(result, seed, waited, detail, self.prefill_chunk),
                             logprobs=logprobs)
        return JSONResponse(body)

    async def _sse(self, job: Job, writer: ChunkWriter, stop, seed, waited: float, detail: str):
        trimmer = StopTrimmer(stop)
        try:
            if writer.chat:
                yield writer.role()
            while True:
                item = await job.events.get()
                if item is END:
                    break
                if isinstance(item, TokenGenerated):
                    delta = trimmer.push(item.text_delta)
                    if delta:
                        yield writer.text(delta)
                elif isinstance(item, GenerationFinished):
                    rest = trimmer.flush()
                    if rest:
                        yield writer.text(rest)
                    self.last = (writer.id, writer.created, item.result)
                    yield writer.finish(item.result, extension(item.result, seed, waited, detail,
                                                               self.prefill_chunk))
                elif isinstance(item, JobFailed):
                    yield writer.error(_engine_error(item.error).body())
            yield writer.done()
        finally:  # normal end, or the client went away (starlette cancels this generator)
            job.cancelled.set()

    # -- the tokenizer (vLLM's /tokenize and /detokenize shapes) -----------------------------------------
    def tokenizer_info(self) -> dict:
        tok = self.engine.tokenizer
        return {"tokenizer_class": type(tok).__name__, "model": self.model_id,
                "eos_token": tok.eos_token, "bos_token": tok.bos_token, "pad_token": tok.pad_token,
                "vocab_size": len(tok), "model_max_length": self.engine.max_context,
                "chat_template": getattr(tok, "chat_template", None)}

    def tokenize(self, req) -> dict:
        self.check_model(req.model)
        if req.messages is not None:
            if req.prompt is not None:
                raise APIError(400, "send either prompt or messages, not both", param="prompt",
                               code="invalid_value")
            messages = chat_messages(req)
            if req.add_generation_prompt:  # exactly what a chat request's prompt becomes
                tokens = self.engine.encode_prompt(messages, chat=True)[0].tolist()
            else:
                enc = self.engine.tokenizer.apply_chat_template(messages, add_generation_prompt=False)
                tokens = list(enc["input_ids"] if not isinstance(enc, list) else enc)
        elif req.prompt is not None:
            tokens = self.engine.tokenizer(req.prompt, add_special_tokens=req.add_special_tokens)["input_ids"]
        else:
            raise APIError(422, "prompt: Field required (add it to the request)", param="prompt",
                           code="missing_field")
        return {"tokens": list(tokens), "count": len(tokens), "max_model_len": self.engine.max_context}

    def detokenize(self, req) -> dict:
        self.check_model(req.model)
        self.prompt_ids(req.tokens)  # the same vocabulary check as a token-id prompt
        return {"prompt": self.engine.tokenizer.decode(req.tokens)}

    def last_report(self) -> dict:
        """The last finished request's full cache report (per-layer rows included), named by its response id."""
        if self.last is None:
            raise APIError(404, "no request has finished yet: send a completion first, then ask again",
                           code="no_report")
        rid, created, result = self.last
        return {"object": "tqbench.cache_report", "id": rid, "created": created, "model": self.model_id,
                "kv_policy": result.kv_policy, "stopped_by": result.stopped_by,
                "cache_report": cache_report_body(result.cache_report, "layers")}

    def health(self) -> dict:
        return {
            "status": "ok" if self.worker.alive else "error",
            "model": self.model_id,
            "kv_policy": self.policy.label,
            "cache_mode": self.cache_mode,
            "max_new_tokens": self.max_new_tokens,
            "queue": {"waiting": self.worker.waiting, "max": self.worker.max_queue,
                      "running": self.worker.running is not None},
            "batch": {"running": len(self.worker.running or ()), "max": self.worker.max_batch,
                      "last_step_size": self.worker.batch_size,
                      "kind": "/".join(self.worker.batch_key) if self.worker.batch_key else None,
                      "unbatched_reason": self.worker.unbatched_reason},
            "prefill_chunk": self.prefill_chunk,
            "requests": dict(self.worker.stats),
            "version": __version__,
        }


def _engine_error(exc: BaseException) -> APIError:
    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if isinstance(exc, ValueError):
        return APIError(400, first, code="invalid_value")
    return APIError(500, f"generation failed: {type(exc).__name__}: {first}", code="generation_failed")


def create_app(engine, *, kv_policy: str | Policy = "turbo4", cache_mode: str = "compressed",
               max_new_tokens: int = 256, max_queue: int = 8, api_key: str | None = None,
               model_aliases: tuple[str, ...] = (), max_batch: int = DEFAULT_MAX_BATCH,
               prefill_chunk: int = 0) -> FastAPI:
    """A FastAPI app serving ``engine``; the worker thread starts and stops with the app's lifespan."""
    server = Server(engine, kv_policy=kv_policy, cache_mode=cache_mode, max_new_tokens=max_new_tokens,
                    max_queue=max_queue, model_aliases=model_aliases, max_batch=max_batch,
                    prefill_chunk=prefill_chunk)

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
