"""What a front end asks a generation for, and the one rule (and message) per field.

``GenerationRequest`` is the request every front end builds from its input (CLI flags, a TUI form, an OpenAI
request body): built once, validated once in ``__post_init__``. Each rule is one function here, each message
written once; the engine's own entry points (``Sampling``, ``Sequence``, ``Engine.encode_prompt``, validation,
NIAH) call the same functions, so a bad value gets the same message through the engine API, the CLI, the TUI and
the server. A rule raises ``RequestError`` (a ``ValueError``) naming the field; a front end whose field has
another name (the server's ``max_tokens``, the CLI's ``--max-new-tokens``) asks for the message in its own
spelling (``RequestError.spelled``). Engine messages never name a CLI flag: the front end that owns one names it.

Torch-free: the CLI checks its flags before loading a model.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


class RequestError(ValueError):
    """A request field with a bad value: ``field``, ``value`` and ``reason`` (what to send instead)."""

    def __init__(self, field: str, value, reason: str) -> None:
        self.field, self.value, self.reason = field, value, reason
        super().__init__(self.spelled(field))

    def spelled(self, field: str) -> str:
        """The message with the field named as the front end names it (e.g. ``max_tokens``)."""
        return f"{field}={_show(self.value)} is invalid: {self.reason}"


class PromptTooLongError(RequestError):
    """The prompt (plus the new tokens asked for) does not fit the model's context (``check_context``)."""

    def __init__(self, prompt_tokens: int, max_new_tokens: int | None, limit: int, model: str,
                 field: str = "max_new_tokens") -> None:
        self.prompt_tokens, self.limit, self.model = prompt_tokens, limit, model
        self.no_room = prompt_tokens > limit or (prompt_tokens == limit and max_new_tokens != 0)
        super().__init__("prompt" if self.no_room else field, max_new_tokens, "")

    def spelled(self, field: str) -> str:
        n, limit, model = self.prompt_tokens, self.limit, self.model
        if self.no_room:
            return (f"the prompt has {n} tokens and {model} has a context of {limit} tokens: no room is left for "
                    "new tokens; shorten the prompt")
        return (f"the prompt has {n} tokens and {field}={self.value} more were asked for, but {model} has a "
                f"context of {limit} tokens: shorten the prompt or lower {field} to at most {limit - n}")


def _show(value) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    return repr(value) if isinstance(value, str) else str(value)


# ---- the rules ---------------------------------------------------------------------------------------------
def check_max_new_tokens(value: int, field: str = "max_new_tokens", *, allow_zero: bool = False) -> int:
    """At least 1 new token (0 only where the prompt alone is scored: ``echo``)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0 or (value == 0 and not allow_zero):
        raise RequestError(field, value, "ask for at least 1 token")
    return value


def check_prompt(text: str) -> str:
    """A text prompt holds something besides white space (the engine's ``encode_prompt`` and the CLI's prompt
    flags check it; the server's chat and completion bodies keep their own OpenAI-shaped errors)."""
    if not text.strip():
        raise ValueError("the prompt is empty: give some text")
    return text


def check_temperature(value: float, field: str = "temperature", maximum: float | None = None) -> float:
    """0 (greedy) or a positive number (up to ``maximum`` where a front end caps it)."""
    if maximum is not None and not 0 <= value <= maximum:
        raise RequestError(field, value, f"use a number from 0 (greedy) to {maximum:g}")
    if value < 0:
        raise RequestError(field, value, "use 0 (greedy) or a positive number")
    return value


def check_top_p(value: float, field: str = "top_p") -> float:
    if not 0 < value <= 1:
        raise RequestError(field, value, "use a number in (0, 1]")
    return value


def check_quality_threshold(value: float, field: str = "quality_threshold") -> float:
    """The share of matching tokens that still counts as near-stable (validation verdicts)."""
    if not 0 < value <= 1:
        raise RequestError(field, value, "use a number in (0, 1]")
    return value


def check_prefill_chunk(value: int, field: str = "prefill_chunk") -> int:
    """Prompt tokens per prefill forward call: 0 (the whole prompt in one call) or a positive number."""
    if value < 0:
        raise RequestError(field, value, "use 0 (the whole prompt in one forward call) or a positive number of "
                                         "tokens per call")
    return value


def check_context(prompt_tokens: int, max_new_tokens: int | None, limit: int, model: str,
                  field: str = "max_new_tokens") -> None:
    """The prompt plus ``max_new_tokens`` must fit ``model``'s context of ``limit`` tokens (0: no limit known).
    ``max_new_tokens`` None: as many as fit (at least 1); 0: the prompt alone (scored, nothing generated)."""
    if not limit:
        return
    if prompt_tokens > limit or (prompt_tokens == limit and max_new_tokens != 0) or \
            (max_new_tokens and prompt_tokens + max_new_tokens > limit):
        raise PromptTooLongError(prompt_tokens, max_new_tokens, limit, model, field)


# ---- the request -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Sampling:
    """Greedy when ``temperature == 0``; otherwise seeded temperature / top-p sampling."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        check_temperature(self.temperature)
        check_top_p(self.top_p)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = Sampling()


@dataclass(frozen=True)
class GenerationRequest:
    """One generation as a front end asks for it: how many new tokens and how to pick them. Validated once,
    here; ``sampling`` is what the engine's ``stream`` / ``sequence`` / ``lockstep`` take."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    echo: bool = False  # score the prompt too (allows max_new_tokens=0)

    def __post_init__(self) -> None:
        check_max_new_tokens(self.max_new_tokens, allow_zero=self.echo)
        self.sampling  # noqa: B018  (checks temperature and top_p)

    @property
    def sampling(self) -> Sampling:
        return Sampling(self.temperature, self.top_p, self.seed)


def check_estimate_args(seq_len: int, batch: int = 1, decoded: int = 0) -> None:
    """A KV estimate's numbers (``cache.estimate.kv_estimate``), torch-free so a front end checks them before any
    engine import: at least one token, ``decoded`` tokens after a prompt of at least one, a batch of at least one."""
    if seq_len < 1:
        raise RequestError("seq_len", seq_len, "use at least 1 token")
    if not 0 <= decoded < seq_len:
        raise RequestError("decoded", decoded, f"use 0 to {seq_len - 1}: the tokens decoded after a prompt of at "
                           "least one token")
    if batch < 1:
        raise RequestError("batch", batch, "use at least 1")


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


def parse_bytes(text: str, what: str = "memory budget") -> int:
    """``24GiB``, ``80GB``, ``512MiB``, ``1e9``: a byte count (GB = 10^9, GiB = 2^30); ``what`` names it in the error."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text or "")
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{what} {text!r} is invalid: use a size like 24GiB, 80GB or 512MiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
