"""Running one request: queue it, wait for its start, then stream SSE chunks or collect a JSON response."""

from __future__ import annotations

import asyncio
import time

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from tqbench.engine.events import GenerationFinished, GenerationStarted, PromptScored, TokenGenerated
from tqbench.server.admission import request_kv_bytes
from tqbench.server.errors import APIError, error_body
from tqbench.server.schemas import chat_messages, completion_prompt
from tqbench.server.stream import (
    ChunkWriter,
    StopTrimmer,
    chat_logprobs,
    completion_logprobs,
    extension,
    full_response,
    new_id,
    warning_header,
)
from tqbench.server.worker import END, Job, JobFailed, JobStarted, QueueFull, ShuttingDown

POLL_SECONDS = 0.2


class RequestRunner:
    """Mixed into ``Server``: needs the checks (``RequestChecks``), ``worker``, ``texts`` and ``engine``."""

    async def handle(self, request: Request, req, chat: bool):
        req.check_supported()
        self.check_model(req.model)
        prompt = chat_messages(req) if chat else completion_prompt(req)
        stop = req.stop_list()
        top, echo = req.logprob_options(chat)
        budget, param = self.token_budget(req, allow_zero=echo, echo_possible=not chat)
        sampling, seed = self.sampling(req)
        policy = self.request_policy(req.kv_policy)
        warning = self.policy_warning if req.kv_policy is None else self.engine.policy_warning(policy)
        mode = self.request_mode(req.cache_mode)
        detail = req.report_detail()
        ids, budget = self.encode(prompt, chat, budget, param)
        prefix, auto = self.prefix_length(req, chat, prompt, ids, echo)
        job = Job(ids, policy, mode, budget, sampling, stop, not req.ignore_eos,
                  asyncio.get_running_loop(), logprobs=top, echo=echo, prefill_chunk=self.prefill_chunk,
                  prefix=prefix, prefix_auto=auto)
        job.kv_bytes = self.reserved_bytes(job, budget)
        if job.kv_bytes > self.kv_budget.bytes:
            raise APIError(400, f"this request's KV cache at {int(ids.shape[1]) + budget} tokens (prompt + "
                           f"{param}) under kv_policy {policy.label!r} takes {job.kv_bytes} bytes, more than the "
                           f"server's whole KV budget of {self.kv_budget.bytes} bytes (tqbench serve --kv-budget): "
                           f"lower {param}, shorten the prompt or pick a smaller kv_policy", param=param,
                           code="kv_budget_exceeded")
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
            writer = ChunkWriter(chat=chat, model=self.model_id, include_usage=req.include_usage,
                                 logprobs=None if top is None else self.texts)
            return StreamingResponse(self._sse(job, writer, stop, seed, waited, detail, warning),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                              **warning_header(warning)})
        echo_text = None
        if echo:
            echo_text = prompt if isinstance(prompt, str) else self.engine.tokenizer.decode(prompt)
        return await self._collect(job, request, chat, stop, seed, waited, detail, top, echo_text, warning)

    def reserved_bytes(self, job: Job, budget: int) -> int:
        """The admission's reservation: the request's cache at prompt + ``budget`` tokens (``request_kv_bytes``),
        appended to its named prefix or the longest one stored now (the worker raises it if it finds another)."""
        n = int(job.ids.shape[1])
        cut = job.prefix
        if not cut and job.prefix_auto:
            entry = self.prefix_cache.longest(job.policy.label, job.cache_mode, tuple(job.ids[0].tolist()),
                                              touch=False)
            cut = len(entry.ids) if entry is not None else 0
        return request_kv_bytes(job.policy, self.engine.geometry, n + budget, prompt=n, prefix=cut)

    def savings_of(self, policy, result):
        """``Engine.savings`` of the request's policy against fp16 at the length its cache held (None without a
        cache report): the engine's rule, so a response never shows a saving the bytes do not make."""
        rep = result.cache_report
        return None if rep is None else self.engine.savings(policy, "fp16", rep.tokens)

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
                       top: int | None = None, echo_text: str | None = None, warning: str | None = None):
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
                             result=result, ext=extension(result, seed, waited, detail, self.prefill_chunk, warning,
                                                          self.savings_of(job.policy, result), job.prefix_use),
                             logprobs=logprobs)
        return JSONResponse(body, headers=warning_header(warning))

    async def _sse(self, job: Job, writer: ChunkWriter, stop, seed, waited: float, detail: str,
                   warning: str | None = None):
        trimmer = StopTrimmer(stop)
        try:
            if writer.chat:
                yield writer.role()
            while True:
                item = await job.events.get()
                if item is END:
                    break
                if isinstance(item, TokenGenerated):
                    writer.add_logprob(item.logprob)
                    delta = trimmer.push(item.text_delta)
                    if delta:
                        yield writer.text(delta)
                elif isinstance(item, GenerationFinished):
                    rest = trimmer.flush()
                    if rest or writer.pending:  # held-back text, or tokens whose logprobs are still unsent
                        yield writer.text(rest)
                    self.last = (writer.id, writer.created, item.result)
                    yield writer.finish(item.result, extension(item.result, seed, waited, detail,
                                                               self.prefill_chunk, warning,
                                                               self.savings_of(job.policy, item.result),
                                                               job.prefix_use))
                elif isinstance(item, JobFailed):
                    yield writer.error(_engine_error(item.error).body())
            yield writer.done()
        finally:  # normal end, or the client went away (starlette cancels this generator)
            job.cancelled.set()


def _engine_error(exc: BaseException) -> APIError:
    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if isinstance(exc, ValueError):
        return APIError(400, first, code="invalid_value")
    return APIError(500, f"generation failed: {type(exc).__name__}: {first}", code="generation_failed")
