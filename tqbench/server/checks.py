"""Request checks: each field a client sends is validated here once, with a message that says what to send."""

from __future__ import annotations

import secrets

from tqbench.engine import (
    CheckedPolicy,
    GenerationRequest,
    PromptTooLongError,
    RequestError,
    Sampling,
    check_context,
    check_max_new_tokens,
    check_temperature,
)
from tqbench.engine.cache import check_mode
from tqbench.server.errors import APIError

MAX_TEMPERATURE = 2.0


class RequestChecks:
    """Mixed into ``Server``: needs ``engine``, ``policy``, ``cache_mode``, ``max_new_tokens``, ``model_id``..."""

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.model_names:
            raise APIError(404, f"model {name!r} is not served here: this server runs {self.model_id!r} "
                           "(see GET /v1/models)", param="model", code="model_not_found")

    def request_policy(self, text: str | None) -> CheckedPolicy:
        if text is None:
            return self.policy
        if "/" in text or "\\" in text or text.strip().endswith((".json", ".toml")):
            raise APIError(400, f"kv_policy={text!r} looks like a file path; the server does not read files "
                           "for clients: send a preset name or a compact policy such as 'k=turbo4,v=turbo4'",
                           param="kv_policy", code="invalid_kv_policy")
        try:
            policy = self.engine.check_policy(text)
        except ValueError as exc:
            raise APIError(400, f"kv_policy={text!r} is invalid: {exc} (GET /v1/kv_policies lists the presets)",
                           param="kv_policy", code="invalid_kv_policy") from None
        return policy

    def sampling(self, req) -> tuple[Sampling, int | None]:
        """The request's sampling (the engine's rules; OpenAI caps temperature at 2)."""
        temperature = 0.0 if req.temperature is None else req.temperature
        top_p = 1.0 if req.top_p is None else req.top_p
        try:
            check_temperature(temperature, maximum=MAX_TEMPERATURE)
            GenerationRequest(temperature=temperature, top_p=top_p)
        except RequestError as exc:
            raise APIError(400, str(exc), param=exc.field, code="invalid_value") from None
        seed = req.seed
        if temperature > 0 and seed is None:
            seed = secrets.randbelow(2**31)
        return Sampling(temperature=temperature, top_p=top_p, seed=seed or 0), seed

    def token_budget(self, req, allow_zero: bool = False, echo_possible: bool = False) -> tuple[int | None, str]:
        """``max_completion_tokens`` / ``max_tokens`` (the engine's rule, in the client's spelling) under the
        server's cap; ``echo_possible`` (``/v1/completions``) adds how a 0 would be allowed."""
        if req.max_completion_tokens is not None:
            value, param = req.max_completion_tokens, "max_completion_tokens"
        else:
            value, param = req.max_tokens, "max_tokens"
        if value is None:
            return None, param
        try:
            check_max_new_tokens(value, param, allow_zero=allow_zero)
        except RequestError as exc:
            hint = " (0 is allowed with echo=true: score the prompt only)" if value == 0 and echo_possible else ""
            raise APIError(400, exc.spelled(param) + hint, param=param, code="invalid_value") from None
        if value > self.max_new_tokens:
            raise APIError(400, f"{param}={value} is above this server's cap of {self.max_new_tokens} tokens "
                           f"(tqbench serve --max-new-tokens): ask for at most {self.max_new_tokens}",
                           param=param, code="invalid_value")
        return value, param

    def encode(self, prompt, chat: bool, budget: int | None, param: str):
        """The prompt's ids and the new-token budget (None: as many as fit, up to the server's cap); a prompt that
        does not fit gets the engine's context message (``check_context``) with ``param`` as the field."""
        limit = self.engine.max_context
        where = "messages" if chat else "prompt"
        try:
            ids = self.prompt_ids(prompt) if isinstance(prompt, list) and not chat else \
                self.engine.encode_prompt(prompt, chat=chat, max_new_tokens=0)
            n = int(ids.shape[1])
            check_context(n, budget, limit, self.model_id, param)
        except PromptTooLongError as exc:
            raise APIError(400, exc.spelled(param), param=where if exc.no_room else param,
                           code="context_length_exceeded") from None
        except APIError:
            raise
        except Exception as exc:  # e.g. a chat template that refuses a role order
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise APIError(400, f"the prompt could not be encoded: {first}", param=where,
                           code="invalid_prompt") from None
        if budget is None:
            budget = self.max_new_tokens if not limit else min(self.max_new_tokens, limit - n)
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

    def request_mode(self, mode: str | None) -> str:
        """The request's ``cache_mode`` extension (default: the server's ``--cache-mode``)."""
        if mode is None:
            return self.cache_mode
        try:
            return check_mode(mode)
        except ValueError as exc:
            raise APIError(400, f"cache_mode={mode!r} is invalid: {exc}", param="cache_mode",
                           code="invalid_value") from None

    def prefix_length(self, req, chat: bool, prompt, ids, echo: bool) -> tuple[int, bool]:
        """(the named prefix's token count, reuse the longest stored prefix) for the ``cache_prefix`` extension.

        chat: ``true`` (the leading system/developer messages) or N (the first N messages), rendered by the chat
        template; completions: the prompt's leading text or its first N tokens; ``false``: no prefix cache;
        absent: reuse the longest stored prefix (when the server has a prefix cache), name none."""
        value = req.cache_prefix
        enabled = self.prefix_cache.enabled
        if value is None:
            return 0, enabled and not echo  # echo scores every prompt token: a stored prefix has no scores
        if value is False:
            return 0, False
        if not enabled:
            raise APIError(400, "cache_prefix needs the server's prefix cache, which is off (tqbench serve "
                           "--prefix-cache 0): remove cache_prefix or start the server with --prefix-cache SIZE",
                           param="cache_prefix", code="unsupported_parameter")
        if echo:
            raise APIError(400, "cache_prefix cannot run with echo=true (a stored prefix's tokens are not scored "
                           "again): remove one of them", param="cache_prefix", code="invalid_value")
        n = int(ids.shape[1])
        if chat:
            if isinstance(value, str):
                raise APIError(400, "cache_prefix on chat completions is true (the leading system messages) or a "
                               "message count, not text", param="cache_prefix", code="invalid_value")
            if value is True:
                value = next((i for i, m in enumerate(prompt) if m["role"] != "system"), len(prompt))
                if value == 0:
                    raise APIError(400, "cache_prefix=true names the leading system messages, and messages starts "
                                   f"with a {prompt[0]['role']!r} message: send the number of leading messages "
                                   "to share instead", param="cache_prefix", code="invalid_value")
            elif not 1 <= value <= len(prompt):
                raise APIError(400, f"cache_prefix={value} is invalid: send a message count from 1 to "
                               f"{len(prompt)} (the leading messages every request shares)", param="cache_prefix",
                               code="invalid_value")
            head = self.message_ids(prompt[:value])
            what = f"the first {value} message{'s' if value > 1 else ''}"
        elif isinstance(value, str):
            if isinstance(prompt, list) or not prompt.startswith(value) or not value:
                raise APIError(400, "cache_prefix text must be a non-empty start of the prompt string: send the "
                               "prompt's leading text (or, for a token-id prompt, a token count)",
                               param="cache_prefix", code="invalid_value")
            head = list(self.engine.tokenizer(value)["input_ids"])
            what = f"the text {value[:24]!r}{'...' if len(value) > 24 else ''}"
        elif isinstance(value, bool):
            raise APIError(400, "cache_prefix=true names a chat's system messages: on /v1/completions send the "
                           "prompt's leading text or a token count", param="cache_prefix", code="invalid_value")
        else:
            if not 1 <= value < n:
                raise APIError(400, f"cache_prefix={value} is invalid: send a token count from 1 to {n - 1} (at "
                               "least one prompt token follows the prefix)", param="cache_prefix",
                               code="invalid_value")
            return value, False
        if not head or len(head) >= n or ids[0, :len(head)].tolist() != head:
            raise APIError(400, f"cache_prefix: {what} tokenize to {len(head)} tokens that are not a proper start "
                           f"of the prompt's {n} tokens (the template or tokenizer joins them with what follows): "
                           "send the prefix as a token count on /v1/completions (POST /tokenize shows the ids)",
                           param="cache_prefix", code="invalid_value")
        return len(head), False

    def message_ids(self, messages: list[dict]) -> list[int]:
        """The token ids of ``messages`` as a chat prompt renders them, without the generation prompt."""
        tok = self.engine.tokenizer
        if not getattr(tok, "chat_template", None):  # Engine.encode_prompt joins the contents with newlines
            return list(tok("\n".join(m["content"] for m in messages))["input_ids"])
        enc = tok.apply_chat_template(messages, add_generation_prompt=False)
        return list(enc["input_ids"] if not isinstance(enc, list) else enc)
