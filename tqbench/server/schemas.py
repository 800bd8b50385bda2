"""Request models: what ``/v1/chat/completions`` and ``/v1/completions`` accept, validated by pydantic.

Fields tqbench cannot honour (penalties, tools, n > 1 ...) are accepted only at their neutral
value; any other value is refused with a message, never silently ignored. Unknown fields are refused.
Extensions: ``kv_policy`` (a preset name or compact policy), ``cache_mode`` (one of the cache modes), ``ignore_eos``,
``cache_prefix`` (the shareable prefix a request starts with: ``server.prefix``) and ``cache_report``
(``"summary"``, the default, or ``"layers"`` to add the per-layer rows to the response's cache report).

``messages[].content`` is a string or a list of content parts (any role). Text parts are joined in order
with nothing between them, as OpenAI does; any other part type (image_url, input_audio, file, refusal ...)
is refused with a 400 that names it.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, StrictStr, field_validator

from tqbench.server.errors import APIError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


TEXT_PART = '{"type": "text", "text": "..."}'


class ChatContentPart(BaseModel):
    """One part of a list ``content``. Any type parses (with its own fields) so that ``chat_messages`` can
    refuse a non-text part by name with a 400; a text part's shape is checked by ``ChatMessage``."""

    model_config = ConfigDict(extra="allow")
    type: StrictStr
    text: StrictStr | None = None


class ChatMessage(_Strict):
    """``content`` is required (a missing one is a 422 ``missing_field``, as the docs say; OpenAI refuses it too):
    tqbench serves no tool calls, so no message may come without its text."""

    role: StrictStr
    content: StrictStr | list[ChatContentPart]
    name: StrictStr | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _content_shape(cls, value: Any) -> Any:
        """One clear message for a malformed content (pydantic's union errors would say 'a valid string')."""
        if isinstance(value, str):
            return value
        if value is None:
            raise ValueError("content is null: send a string or a list of content parts (tool calls are not "
                             "served here)")
        if not isinstance(value, list):
            raise ValueError(f"send a string or a list of content parts such as [{TEXT_PART}]")
        for j, part in enumerate(value):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise ValueError(f"part {j} must be an object with a string \"type\", such as {TEXT_PART}")
            if part["type"] != "text":
                continue  # refused by name (400) in chat_messages
            if not isinstance(part.get("text"), str):
                raise ValueError(f"part {j} is a text part without a string \"text\": send {TEXT_PART}")
            extra = sorted(set(part) - {"type", "text"})
            if extra:
                raise ValueError(f"part {j} has {', '.join(map(repr, extra))}: a text part takes only \"type\" "
                                 "and \"text\" (remove the other fields)")
        return value


class StreamOptions(_Strict):
    include_usage: StrictBool = False
    include_obfuscation: StrictBool | None = None


REPORT_DETAILS = ("summary", "layers")
MAX_TOP_LOGPROBS = 20  # the most alternatives per token a request may ask for (OpenAI's limit for chat)  # values of the cache_report extension

# field -> (neutral values accepted, what to do instead)
UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "frequency_penalty": ((None, 0, 0.0), "penalties are not implemented: remove it or send 0"),
    "presence_penalty": ((None, 0, 0.0), "penalties are not implemented: remove it or send 0"),
    "logit_bias": ((None, {}), "logit_bias is not implemented: remove it"),
    "tools": ((None, []), "tool calling is not implemented: remove tools"),
    "tool_choice": ((None, "none"), "tool calling is not implemented: remove tool_choice"),
    "functions": ((None, []), "function calling is not implemented: remove functions"),
    "function_call": ((None, "none"), "function calling is not implemented: remove function_call"),
    "response_format": ((None, {"type": "text"}), "only plain text output is supported: remove response_format"),
    "best_of": ((None, 1), "best_of > 1 is not supported: remove it or send 1"),
    "suffix": ((None, ""), "suffix is not supported: remove it"),
}


class _Common(_Strict):
    model: StrictStr | None = None
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    n: StrictInt | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    # tqbench extensions
    kv_policy: StrictStr | None = None
    cache_mode: StrictStr | None = None  # one of tqbench.constants.CACHE_MODES (default: the server's)
    ignore_eos: StrictBool = False
    cache_report: StrictStr | None = None  # "summary" (default) or "layers"
    # the shareable prefix (server.prefix): chat: true (the leading system messages) or N messages; completions:
    # the prompt's leading text or its first N tokens; false: no prefix cache; absent: the longest stored prefix
    cache_prefix: StrictBool | StrictInt | StrictStr | None = None
    # accepted and ignored: they change nothing about the output
    user: StrictStr | None = None
    metadata: dict[str, Any] | None = None
    store: StrictBool | None = None
    service_tier: StrictStr | None = None
    safety_identifier: StrictStr | None = None
    prompt_cache_key: StrictStr | None = None
    parallel_tool_calls: StrictBool | None = None
    # refused unless neutral (see UNSUPPORTED)
    frequency_penalty: StrictFloat | None = None
    presence_penalty: StrictFloat | None = None
    logit_bias: dict[str, Any] | None = None
    logprobs: StrictBool | StrictInt | None = None
    top_logprobs: StrictInt | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None
    best_of: StrictInt | None = None
    echo: StrictBool | None = None
    suffix: StrictStr | None = None

    def check_supported(self) -> None:
        for name, (neutral, fix) in UNSUPPORTED.items():
            value = getattr(self, name, None)
            if value not in neutral:
                raise APIError(400, f"{name}={value!r} is not supported by tqbench serve: {fix}",
                               param=name, code="unsupported_parameter")
        if self.n is not None and self.n != 1:
            raise APIError(400, f"n={self.n} is not supported: tqbench serve returns one choice; send n=1",
                           param="n", code="unsupported_parameter")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream=true", param="stream_options",
                           code="invalid_value")

    def stop_list(self) -> list[str] | None:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 4:
            raise APIError(400, f"stop has {len(stops)} sequences: send at most 4", param="stop",
                           code="invalid_value")
        if any(s == "" for s in stops):
            raise APIError(400, "stop contains an empty string: every stop sequence needs text", param="stop",
                           code="invalid_value")
        return stops or None

    def report_detail(self) -> str:
        """How much cache report the response carries: ``summary`` (the default) or ``layers``."""
        detail = "summary" if self.cache_report is None else self.cache_report
        if detail not in REPORT_DETAILS:
            raise APIError(400, f"cache_report={detail!r} is invalid: send 'summary' (the default: totals, "
                           "bits/element, saving, mode, fallbacks) or 'layers' (the summary plus the per-layer "
                           "rows)", param="cache_report", code="invalid_value")
        return detail

    def logprob_options(self, chat: bool) -> tuple[int | None, bool]:
        """(top alternatives per token, or None for no logprobs; echo) after checking the fields' shapes.

        Chat: ``logprobs: true`` with ``top_logprobs`` 0-20. Completions: ``logprobs: N`` (0-20) and ``echo``.
        """
        if chat:
            if self.echo:
                raise APIError(400, "echo is a /v1/completions field: chat completions do not echo the prompt; "
                               "remove it or send the prompt to /v1/completions", param="echo",
                               code="unsupported_parameter")
            if self.logprobs is not None and not isinstance(self.logprobs, bool):
                raise APIError(400, f"logprobs={self.logprobs!r} is invalid for chat completions: send true or "
                               "false, and the number of alternatives as top_logprobs", param="logprobs",
                               code="invalid_value")
            top = self.top_logprobs
            if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
                raise APIError(400, f"top_logprobs={top} is invalid: send an integer from 0 to {MAX_TOP_LOGPROBS}",
                               param="top_logprobs", code="invalid_value")
            if not self.logprobs:
                if top:
                    raise APIError(400, "top_logprobs needs logprobs=true: add \"logprobs\": true",
                                   param="top_logprobs", code="invalid_value")
                return None, False
            wanted, echo = top or 0, False
        else:
            if self.top_logprobs is not None:
                raise APIError(400, "top_logprobs is a chat completions field: on /v1/completions send the number "
                               "of alternatives as logprobs (an integer)", param="top_logprobs",
                               code="unsupported_parameter")
            if isinstance(self.logprobs, bool):
                raise APIError(400, f"logprobs={self.logprobs!r} is invalid for /v1/completions: send an integer, "
                               f"the number of alternatives per token (0-{MAX_TOP_LOGPROBS})", param="logprobs",
                               code="invalid_value")
            if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
                raise APIError(400, f"logprobs={self.logprobs} is invalid: send an integer from 0 to "
                               f"{MAX_TOP_LOGPROBS}", param="logprobs", code="invalid_value")
            wanted, echo = self.logprobs, bool(self.echo)
        if self.stream and echo:
            raise APIError(400, "echo is not supported with stream=true: send stream=false (logprobs stream)",
                           param="echo", code="unsupported_parameter")
        return wanted, echo

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]


class CompletionRequest(_Common):
    # a string, or token ids (what lm-evaluation-harness sends); a one-element list of either
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]


class TokenizeRequest(_Strict):
    """``POST /tokenize`` (vLLM's shape): a prompt string, or chat messages rendered by the chat template."""

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True


class DetokenizeRequest(_Strict):
    model: StrictStr | None = None
    tokens: list[StrictInt]


ROLES = ("system", "developer", "user", "assistant", "tool")


def chat_messages(req: ChatCompletionRequest) -> list[dict]:
    """Plain ``{role, content}`` dicts for the chat template; text parts joined in order with no separator
    (OpenAI's behaviour); any other part type is a 400 naming it."""
    if not req.messages:
        raise APIError(400, "messages is empty: send at least one {\"role\": \"user\", \"content\": ...} message",
                       param="messages", code="invalid_value")
    out = []
    for i, msg in enumerate(req.messages):
        if msg.role not in ROLES:
            raise APIError(400, f"messages.{i}.role={msg.role!r} is unknown: use one of {', '.join(ROLES)}",
                           param=f"messages.{i}.role", code="invalid_value")
        content = msg.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise APIError(400, f"messages.{i}.content.{j} has type {part.type!r}: only text parts "
                                   f"({TEXT_PART}) are supported: remove the part or send its content as text",
                                   param=f"messages.{i}.content.{j}.type", code="invalid_value")
                texts.append(part.text)
            content = "".join(texts)
        role = "system" if msg.role == "developer" else msg.role
        out.append({"role": role, "content": content})
    return out


def completion_prompt(req: CompletionRequest) -> str | list[int]:
    """The prompt text, or its token ids when the client sent ids."""
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise APIError(400, f"prompt is a list of {len(prompt)} prompts: send one prompt (a string) per "
                           "request", param="prompt", code="invalid_value")
        prompt = prompt[0]
        if isinstance(prompt, list):
            if not prompt:
                raise APIError(400, "prompt is an empty list of token ids: send at least one token", param="prompt",
                               code="invalid_value")
            return list(prompt)
    if not prompt.strip():
        raise APIError(400, "prompt is empty: send some text", param="prompt", code="invalid_value")
    return prompt
