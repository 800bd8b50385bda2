"""Request checks: each field a client sends is validated here once, with a message that says what to send."""

from __future__ import annotations

import secrets

from tqbench.engine import Policy, PromptTooLongError, Sampling, parse_policy
from tqbench.engine.cache import check_mode
from tqbench.server.errors import APIError

MAX_TEMPERATURE = 2.0


class RequestChecks:
    """Mixed into ``Server``: needs ``engine``, ``policy``, ``cache_mode``, ``max_new_tokens``, ``model_id``..."""

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

    def request_mode(self, mode: str | None) -> str:
        """The request's ``cache_mode`` extension (default: the server's ``--cache-mode``)."""
        if mode is None:
            return self.cache_mode
        try:
            return check_mode(mode)
        except ValueError as exc:
            raise APIError(400, f"cache_mode={mode!r} is invalid: {exc}", param="cache_mode",
                           code="invalid_value") from None
