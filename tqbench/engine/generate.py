"""Prefill / decode-one / stream of events, and lockstep baseline+candidate generation.

The long-job protocol (one rule for every long job in the engine):

- **Progress**: a generator job (``stream_tokens``, ``lockstep``, ``Engine.stream`` / ``Engine.lockstep``)
  yields event dataclasses from ``tqbench.engine.events``; every other long job takes
  ``on_event: Callable[[event], None] | None = None`` and passes it the same dataclasses.
- **Cancel**: every long job takes ``cancel: Callable[[], bool] | None = None`` and checks it every step.
- **Generation returns partial**: ``stream_tokens``, ``lockstep``, ``Engine.stream``, ``Engine.lockstep`` and
  ``Engine.generate`` stop at the next token and end normally with ``stopped_by="cancelled"`` (a cancelled
  generation still has tokens to show).
- **Every other job raises**: ``validate``, ``self_test``, ``compare_policies``, ``teacher_forced_quality``,
  ``baseline_logprobs``, ``teacher_forced``, ``needle_in_haystack`` (``tqbench.engine.validate``) and
  ``scan``, ``capture_qkv`` (``tqbench.engine.scan``) raise ``Cancelled`` and return nothing: a half-done
  report would read as a finished one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from tqbench.engine.events import (
    Cancelled,
    GenerationFinished,
    GenerationStarted,
    PairStep,
    PrefillDone,
    TokenGenerated,
)
from tqbench.engine.metrics import kl_divergence

__all__ = ["GREEDY", "Cancelled", "GenerationResult", "Sampling", "TextStreamer", "lockstep", "stream_tokens"]


@dataclass(frozen=True)
class Sampling:
    """Greedy when ``temperature == 0``; otherwise seeded temperature / top-p sampling."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} is invalid: use 0 (greedy) or a positive number")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} is invalid: use a number in (0, 1]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = Sampling()


@dataclass
class GenerationResult:
    run: str
    kv_policy: str
    cache_mode: str
    input_tokens: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    step_seconds: list[float] = field(default_factory=list)  # decode steps only (the first token is prefill)
    prefill_seconds: float = 0.0
    stopped_by: str = "max_new_tokens"  # or "eos", "stop", "cancelled"
    cache_report: object | None = None

    @property
    def output_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def decode_seconds(self) -> float:
        return float(sum(self.step_seconds))

    @property
    def elapsed_seconds(self) -> float:
        return self.prefill_seconds + self.decode_seconds

    @property
    def decode_tokens_per_second(self) -> float:
        n = len(self.step_seconds)
        return n / self.decode_seconds if n and self.decode_seconds > 0 else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.elapsed_seconds if self.elapsed_seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "run": self.run,
            "kv_policy": self.kv_policy,
            "cache_mode": self.cache_mode,
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "token_ids": list(self.token_ids),
            "text": self.text,
            "stopped_by": self.stopped_by,
            "prefill_seconds": round(self.prefill_seconds, 6),
            "decode_seconds": round(self.decode_seconds, 6),
            "elapsed_seconds": round(self.elapsed_seconds, 6),
            "tokens_per_second": round(self.tokens_per_second, 3),
            "decode_tokens_per_second": round(self.decode_tokens_per_second, 3),
            "cache_report": self.cache_report.to_dict() if self.cache_report is not None else None,
        }


def _pick(logits: torch.Tensor, sampling: Sampling, gen: torch.Generator | None) -> int:
    if sampling.greedy:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / sampling.temperature, dim=-1)
    if sampling.top_p < 1:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, 0) - sorted_p < sampling.top_p
        keep[0] = True
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
    return int(torch.multinomial(probs, 1, generator=gen))


class TextStreamer:
    """Incremental detokenization that never emits half of a multi-byte character."""

    def __init__(self, tokenizer) -> None:
        self.tok = tokenizer
        self.ids: list[int] = []
        self.emitted = ""

    def push(self, token_id: int, final: bool = False) -> str:
        self.ids.append(token_id)
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd") and not final:
            return ""
        delta = text[len(self.emitted) :] if text.startswith(self.emitted) else ""
        self.emitted = text if text.startswith(self.emitted) else self.emitted
        return delta

    def text(self) -> str:
        return self.tok.decode(self.ids, skip_special_tokens=True)


def stream_tokens(
    model,
    tokenizer,
    input_ids: torch.Tensor,
    cache,
    *,
    run: str,
    kv_policy: str,
    cache_mode: str,
    max_new_tokens: int,
    sampling: Sampling = GREEDY,
    eos_ids: set[int] | None = None,
    stop: list[str] | None = None,
    collect_logits: bool = False,
    cancel: Callable[[], bool] | None = None,
    report: Callable[[], object] | None = None,
) -> Iterator[object]:
    """Prefill ``input_ids`` ([1, T]) into ``cache``, then decode token by token, yielding events."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} is invalid: ask for at least 1 token")
    gen = None
    if not sampling.greedy:
        gen = torch.Generator(device="cpu").manual_seed(sampling.seed)
    result = GenerationResult(run, kv_policy, cache_mode, int(input_ids.shape[1]))
    yield GenerationStarted(run, kv_policy, cache_mode, result.input_tokens)
    streamer = TextStreamer(tokenizer)
    eos_ids = eos_ids or set()
    device = next(model.parameters()).device
    ids = input_ids.to(device)
    # inference mode per forward call, not around the loop: a generator suspended inside a `with` block leaves
    # the thread's grad mode to whichever interleaved stream (lockstep) exits last
    t0 = time.perf_counter()
    logits = _forward(model, ids, cache).logits[0, -1]
    dt = time.perf_counter() - t0
    result.prefill_seconds = dt
    yield PrefillDone(run, result.input_tokens, dt)
    for step in range(max_new_tokens):
        if cancel is not None and cancel():
            result.stopped_by = "cancelled"
            break
        logits_cpu = logits.detach().float().cpu()
        tok = _pick(logits_cpu, sampling, gen)
        result.token_ids.append(tok)
        if step > 0:
            result.step_seconds.append(dt)
        final = tok in eos_ids or step == max_new_tokens - 1
        delta = streamer.push(tok, final)
        yield TokenGenerated(
            run, step, tok, delta, dt, int(torch.argmax(logits_cpu)), logits_cpu if collect_logits else None
        )
        if tok in eos_ids:
            result.stopped_by = "eos"
            break
        if stop and any(s in streamer.emitted for s in stop):
            result.stopped_by = "stop"
            break
        if step == max_new_tokens - 1:
            break
        t0 = time.perf_counter()
        nxt = torch.tensor([[tok]], device=device)
        logits = _forward(model, nxt, cache).logits[0, -1]
        dt = time.perf_counter() - t0
    result.text = streamer.emitted
    if report is not None:
        result.cache_report = report()
    yield GenerationFinished(run, result)


@torch.inference_mode()
def _forward(model, ids: torch.Tensor, cache):
    return model(input_ids=ids, cache=cache, use_cache=True)


def lockstep(baseline: Iterator[object], candidate: Iterator[object]) -> Iterator[object]:
    """Interleave two token streams step by step; yields their non-token events and one ``PairStep`` per step."""
    streams = {"baseline": baseline, "candidate": candidate}
    done = {"baseline": False, "candidate": False}
    step = 0
    while not all(done.values()):
        tokens: dict[str, TokenGenerated | None] = {}
        for name, it in streams.items():
            tokens[name] = None
            while not done[name]:
                try:
                    ev = next(it)
                except StopIteration:
                    done[name] = True
                    break
                if isinstance(ev, TokenGenerated):
                    tokens[name] = ev
                    break
                yield ev
        b, c = tokens["baseline"], tokens["candidate"]
        if b is None and c is None:
            continue
        kl = None
        if b is not None and c is not None and b.logits is not None and c.logits is not None:
            kl = kl_divergence(b.logits, c.logits)
        yield PairStep(
            step,
            b,
            c,
            same_token=b is not None and c is not None and b.token_id == c.token_id,
            same_top1=b is not None and c is not None and b.top1_id == c.top1_id,
            kl=kl,
        )
        step += 1
