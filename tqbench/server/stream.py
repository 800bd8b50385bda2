"""OpenAI response and chunk bodies, and stop-sequence trimming for streamed text."""

from __future__ import annotations

import json
import time
import uuid

FINISH_REASONS = {"eos": "stop", "stop": "stop", "max_new_tokens": "length", "cancelled": "stop"}


class StopTrimmer:
    """Holds back text that could be the start of a stop sequence; cuts the text at the first stop.

    OpenAI semantics: the returned text never contains the stop sequence. The engine stops generating as
    soon as a stop string appears in its text; this class decides what the client may see so far.
    """

    def __init__(self, stops: list[str] | None) -> None:
        self.stops = stops or []
        self.text = ""
        self.sent = 0
        self.cut: int | None = None

    def push(self, delta: str) -> str:
        """The newly safe text after ``delta``."""
        if self.cut is not None:
            return ""
        self.text += delta
        hits = [self.text.find(s) for s in self.stops if s in self.text]
        if hits:
            self.cut = min(hits)
            safe = self.cut
        else:
            hold = 0
            for s in self.stops:
                for k in range(min(len(s) - 1, len(self.text)), 0, -1):
                    if self.text.endswith(s[:k]):
                        hold = max(hold, k)
                        break
            safe = len(self.text) - hold
        out = self.text[self.sent:safe] if safe > self.sent else ""
        self.sent = max(self.sent, safe)
        return out

    def flush(self) -> str:
        """Whatever was held back once generation ended without completing a stop sequence."""
        end = self.cut if self.cut is not None else len(self.text)
        out = self.text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return out

    @property
    def final_text(self) -> str:
        return self.text[: self.cut] if self.cut is not None else self.text


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def usage(result, prefix: dict | None = None) -> dict:
    """OpenAI's usage; a request that read a compressed prefix (``server.prefix``) counts the prefix in
    ``prompt_tokens`` and, when it was stored before (not prefilled for this request), in
    ``prompt_tokens_details.cached_tokens`` (OpenAI's field for prompt-cache hits); ``prefix``: the extension's
    ``prefix_cache`` object."""
    prompt = result.input_tokens + result.prefix_tokens
    out = {
        "prompt_tokens": prompt,
        "completion_tokens": result.output_tokens,
        "total_tokens": prompt + result.output_tokens,
    }
    if prefix is not None:
        out["prompt_tokens_details"] = {"cached_tokens": prefix["tokens"] if prefix["hit"] else 0}
    return out


PER_LAYER_FIELDS = ("layers", "bypassed_layers")  # CacheReport fields that grow with the layer count


def cache_report_body(report, detail: str = "summary") -> dict | None:
    """The response's ``cache_report``: the summary (everything but the per-layer lists, so its size does not
    grow with the layer count, plus ``layer_count`` and ``bypassed_layer_count``), or with ``detail="layers"``
    the summary plus ``layers`` (one row per layer) and ``bypassed_layers`` (the full ``bench --json`` report).
    """
    if report is None:
        return None
    full = report.to_dict()
    body = {k: v for k, v in full.items() if k not in PER_LAYER_FIELDS}
    body["layer_count"] = len(report.layers)
    body["bypassed_layer_count"] = len(report.bypassed_layers)
    if detail == "layers":
        body.update({k: full[k] for k in PER_LAYER_FIELDS})
    return body


#: the response header that carries ``Engine.policy_warning`` (the request's policy was fitted on another model)
POLICY_WARNING_HEADER = "X-TQBench-Policy-Warning"


def warning_header(warning: str | None) -> dict[str, str]:
    """``{POLICY_WARNING_HEADER: warning}`` when there is one (HTTP headers are Latin-1: others become '?')."""
    if not warning:
        return {}
    return {POLICY_WARNING_HEADER: warning.encode("latin-1", "replace").decode("latin-1")}


def extension(result, seed: int | None, waited: float, detail: str = "summary", prefill_chunk: int = 0,
              policy_warning: str | None = None, savings=None, prefix_use=None) -> dict:
    """The ``tqbench`` extension field: the request's KV policy, its cache report and timings,
    ``policy_warning`` (None, or why the policy may not suit this model: fitted on another one) and
    ``savings`` (``engine.cache.savings.Savings`` against fp16 at the length the cache held: whether the policy
    saved anything, why not, and from which length it would; None without a cache report)."""
    return {
        "kv_policy": result.kv_policy,
        "policy_warning": policy_warning,
        "cache_mode": result.cache_mode,
        "stopped_by": result.stopped_by,
        "seed": seed,
        "token_ids": list(result.token_ids),
        "queue_seconds": round(waited, 6),
        "prefill_seconds": round(result.prefill_seconds, 6),
        "decode_seconds": round(result.decode_seconds, 6),
        "decode_tokens_per_second": round(result.decode_tokens_per_second, 3),
        "cache_report": cache_report_body(result.cache_report, detail),
        "prefill_chunk": prefill_chunk,  # prompt tokens per prefill forward call (0: the whole prompt in one)
        "savings": savings.to_dict() if savings is not None else None,
        # the compressed prefix the request started from (server.prefix.PrefixUse), None: none
        "prefix_cache": prefix_use.to_dict() if prefix_use is not None else None,
    }


class TokenTexts:
    """Each token id's own text (``tokenizer.decode([id])``, cached): the ``token`` strings of a logprobs body.

    A byte-level token that is part of a multi-byte character decodes to U+FFFD on its own, as in OpenAI's
    responses; its ``bytes`` are then those of the replacement character."""

    def __init__(self, tokenizer) -> None:
        self.tok = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self.cache.get(token_id)
        if text is None:
            text = self.cache[token_id] = self.tok.decode([token_id])
        return text


def chat_logprobs(generated: list, texts: TokenTexts) -> dict:
    """``choices[0].logprobs`` of a chat completion: one entry per generated token (``TokenLogprob``s)."""
    def entry(token_id: int, logprob: float) -> dict:
        text = texts(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(g.token_id, g.logprob), "top_logprobs": [entry(i, lp) for i, lp in g.top]}
                        for g in generated],
            "refusal": None}


def completion_logprobs(generated: list, texts: TokenTexts, prompt=None, start_offset: int = 0) -> dict:
    """``choices[0].logprobs`` of a legacy completion: ``tokens``, ``token_logprobs``, ``top_logprobs`` and
    ``text_offset``; with ``prompt`` (a ``PromptScored``, for ``echo``) the prompt's tokens come first, the
    first of them with null log-probability and null alternatives (nothing predicts it)."""
    ids: list[int] = []
    lps: list[float | None] = []
    tops: list[dict | None] = []
    if prompt is not None:
        ids.append(prompt.first_token_id)
        lps.append(None)
        tops.append(None)
    for s in [*(prompt.scores if prompt is not None else ()), *generated]:
        ids.append(s.token_id)
        lps.append(s.logprob)
        top: dict[str, float] = {}
        for i, lp in s.top:  # best first: where two ids share a text, the likelier one keeps the key
            top.setdefault(texts(i), lp)
        tops.append(top)
    tokens = [texts(i) for i in ids]
    offsets, at = [], start_offset
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def full_response(*, chat: bool, rid: str, model: str, created: int, text: str, result, ext: dict,
                  logprobs: dict | None = None) -> dict:
    finish = FINISH_REASONS.get(result.stopped_by, "stop")
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                  "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
    return {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage(result, ext.get("prefix_cache")),
        "tqbench": ext,
    }


class ChunkWriter:
    """Server-sent-event lines in the OpenAI chunk format for one streamed request."""

    def __init__(self, *, chat: bool, model: str, include_usage: bool, logprobs: TokenTexts | None = None) -> None:
        self.chat = chat
        self.model = model
        self.include_usage = include_usage
        self.texts = logprobs  # with logprobs: each text chunk carries the logprobs of the tokens it completes
        self.pending: list = []  # generated-token logprobs not sent yet (their text may be held by the trimmer)
        self.offset = 0  # characters of completion text sent so far (legacy completions' text_offset)
        self.id = new_id(chat)
        self.created = int(time.time())

    def _chunk(self, choices: list[dict], **extra) -> str:
        body = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.include_usage:
            body["usage"] = None
        body.update(extra)
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    def _choice(self, text: str | None, finish: str | None, role: bool = False, logprobs: dict | None = None) -> dict:
        if self.chat:
            delta: dict = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            return {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish}

    def add_logprob(self, entry) -> None:
        if self.texts is not None and entry is not None:
            self.pending.append(entry)

    def _take_logprobs(self) -> dict | None:
        """The pending tokens' logprobs in the chunk shape (chat: ``content`` entries; completions: the
        ``tokens`` / ``token_logprobs`` / ``top_logprobs`` / ``text_offset`` lists, offsets running on)."""
        if self.texts is None:
            return None
        taken, self.pending = self.pending, []
        if self.chat:
            return chat_logprobs(taken, self.texts)
        body = completion_logprobs(taken, self.texts, start_offset=self.offset)
        self.offset += sum(len(t) for t in body["tokens"])
        return body

    def role(self) -> str:
        return self._chunk([self._choice("", None, role=True)])

    def text(self, delta: str) -> str:
        return self._chunk([self._choice(delta, None, logprobs=self._take_logprobs())])

    def finish(self, result, ext: dict) -> str:
        """The chunk with finish_reason; then, with include_usage, OpenAI's extra chunk with empty choices.

        Without include_usage the finish chunk itself carries ``usage`` (usage is in every response).
        """
        finish = FINISH_REASONS.get(result.stopped_by, "stop")
        choice = [self._choice(None if self.chat else "", finish)]
        used = usage(result, ext.get("prefix_cache"))
        if not self.include_usage:
            return self._chunk(choice, usage=used, tqbench=ext)
        return self._chunk(choice, tqbench=ext) + self._chunk([], usage=used, tqbench=ext)

    @staticmethod
    def error(body: dict) -> str:
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    @staticmethod
    def done() -> str:
        return "data: [DONE]\n\n"
