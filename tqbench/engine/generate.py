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

from tqbench.constants import auto_prefill_chunk
from tqbench.engine.events import (
    Cancelled,
    GenerationFinished,
    GenerationStarted,
    PairStep,
    PrefillDone,
    PromptScored,
    TokenGenerated,
)
from tqbench.engine.metrics import kl_divergence, token_logprobs
from tqbench.engine.request import GREEDY, Sampling, check_max_new_tokens, check_prefill_chunk
from tqbench.engine.speculative import PromptLookup, SpeculationStats

__all__ = ["GREEDY", "Cancelled", "GenerationResult", "Sampling", "Sequence", "TextStreamer", "lockstep", "prefill",
           "stream_tokens"]




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
    speculation: SpeculationStats | None = None  # prompt-lookup decoding's drafts (``Engine.stream(prompt_lookup=)``)
    context_pass_seconds: float = 0.0  # a context-pass score's scoring pass before the prefill (score=kvzip)
    #: tokens of a compressed context (``Engine.compress``) the run read before ``input_tokens`` (not prefilled)
    prefix_tokens: int = 0

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
        } | ({"speculation": self.speculation.to_dict()} if self.speculation is not None else {}) | (
            {"context_pass_seconds": round(self.context_pass_seconds, 6)} if self.context_pass_seconds else {}) | (
            {"prefix_tokens": self.prefix_tokens} if self.prefix_tokens else {})


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


class Sequence:
    """One generation as a step machine, so that a driver can run its forward calls alone or in a batch.

    ``start()`` prefills the prompt (in forward calls of ``prefill_chunk`` tokens; 0 = one call; None = by
    length, ``constants.auto_prefill_chunk``) and, with
    ``echo``, scores every prompt token on the way; then each ``step()`` picks a token from the current logits
    and either finishes or names ``next_token``, whose forward call (solo: ``stream_tokens``; batched:
    ``tqbench.engine.batch.decode_step``) hands the next logits back through ``feed()``. Every method returns
    the events it produced, in order.
    """

    def __init__(self, model, tokenizer, input_ids: torch.Tensor, cache, *, run: str, kv_policy: str,
                 cache_mode: str, max_new_tokens: int, sampling: Sampling = GREEDY, eos_ids: set[int] | None = None,
                 stop: list[str] | None = None, collect_logits: bool = False, cancel: Callable[[], bool] | None = None,
                 report: Callable[[], object] | None = None, logprobs: int | None = None, echo: bool = False,
                 prefill_chunk: int | None = None) -> None:
        check_max_new_tokens(max_new_tokens, allow_zero=echo)
        # None: chosen by length and mode (``constants.auto_prefill_chunk``, the ``--prefill-chunk auto`` rule)
        prefill_chunk = auto_prefill_chunk(int(input_ids.shape[1]), cache_mode, prefill_chunk)
        check_prefill_chunk(prefill_chunk)
        if logprobs is not None and logprobs < 0:
            raise ValueError(f"logprobs={logprobs} is invalid: ask for 0 or more top alternatives")
        self.model, self.tokenizer, self.cache = model, tokenizer, cache
        self.device = next(model.parameters()).device
        self.ids = input_ids.to(self.device)
        self.run, self.max_new_tokens, self.sampling = run, max_new_tokens, sampling
        self.eos_ids = eos_ids or set()
        self.stop, self.collect_logits, self.cancel, self.report = stop, collect_logits, cancel, report
        self.logprobs, self.echo, self.prefill_chunk = logprobs, echo, prefill_chunk
        self.gen = None if sampling.greedy else torch.Generator(device="cpu").manual_seed(sampling.seed)
        self.result = GenerationResult(run, kv_policy, cache_mode, int(input_ids.shape[1]))
        self.streamer = TextStreamer(tokenizer)
        self.logits: torch.Tensor | None = None  # the distribution the next step picks from
        self.dt = 0.0  # wall time of the forward call that produced ``logits``
        self.next_token: int | None = None
        self.done = False

    @property
    def context_tokens(self) -> int:
        """Tokens the cache holds (prompt + fed tokens): the position of ``next_token``."""
        return self.result.input_tokens + max(0, self.result.output_tokens - 1)

    def start(self) -> list:
        events: list = [GenerationStarted(self.run, self.result.kv_policy, self.result.cache_mode,
                                          self.result.input_tokens)]
        t0 = time.perf_counter()
        self.logits, scores = prefill(self.model, self.ids, self.cache, chunk=self.prefill_chunk,
                                      score_top=self.logprobs or 0 if self.echo else None)
        self.dt = time.perf_counter() - t0
        self.result.prefill_seconds = self.dt
        events.append(PrefillDone(self.run, self.result.input_tokens, self.dt))
        if scores is not None:
            events.append(PromptScored(self.run, int(self.ids[0, 0]), tuple(scores)))
        if self.max_new_tokens == 0:
            events.append(self._finish())
        return events

    def step(self) -> list:
        """Pick the next token from the current logits; the events of this step (and the finish, if it ends)."""
        assert not self.done and self.logits is not None
        step = self.result.output_tokens
        if self.cancel is not None and self.cancel():
            self.result.stopped_by = "cancelled"
            return [self._finish()]
        logits_cpu = self.logits.detach().float().cpu()
        tok = _pick(logits_cpu, self.sampling, self.gen)
        self.result.token_ids.append(tok)
        if step > 0:
            self.result.step_seconds.append(self.dt)
        final = tok in self.eos_ids or step == self.max_new_tokens - 1
        delta = self.streamer.push(tok, final)
        lp = None
        if self.logprobs is not None:
            lp = token_logprobs(self.logits.view(1, -1), [tok], self.logprobs)[0]
        events: list = [TokenGenerated(self.run, step, tok, delta, self.dt, int(torch.argmax(logits_cpu)),
                                       logits_cpu if self.collect_logits else None, lp)]
        if tok in self.eos_ids:
            self.result.stopped_by = "eos"
        elif self.stop and any(s in self.streamer.emitted for s in self.stop):
            self.result.stopped_by = "stop"
        elif step < self.max_new_tokens - 1:
            self.next_token = tok
            return events
        events.append(self._finish())
        return events

    def feed(self, logits: torch.Tensor, seconds: float) -> None:
        """The logits of the forward call over ``next_token`` (and how long that call took)."""
        self.logits, self.dt, self.next_token = logits, seconds, None

    def _finish(self) -> GenerationFinished:
        self.done = True
        self.next_token = None
        self.logits = None
        self.result.text = self.streamer.emitted
        if self.report is not None:
            self.result.cache_report = self.report()
        return GenerationFinished(self.run, self.result)


def prefill(model, ids: torch.Tensor, cache, *, chunk: int = 0, score_top: int | None = None):
    """Feed the prompt ``ids`` ([1, T]) into ``cache``; (logits of the last position, prompt scores or None).

    ``chunk`` > 0 feeds it in forward calls of that many tokens, so a call attends exactly over its own rows and
    reads earlier calls' rows as the cache stored them (compressed history); 0 is one call (exact K/V
    throughout). With ``score_top`` (the number of top alternatives, 0 for none) the result also scores every
    prompt token after the first: ``TokenLogprob`` of token i+1 under position i's distribution.
    """
    n = ids.shape[1]
    step = chunk if chunk > 0 else n
    scores: list | None = [] if score_top is not None else None
    last = None
    cuts = list(range(0, n, step)) + [n]
    if getattr(cache, "evicts", False) and len(cuts) > 2 and cuts[-1] - cuts[-2] == 1:
        del cuts[-2]  # token eviction runs at the end of each call of more than one row: no 1-row last chunk
    for a, b in zip(cuts, cuts[1:]):
        logits = _forward(model, ids[:, a:b], cache).logits[0]
        if scores is not None:
            targets = ids[0, a + 1 : b + 1]
            scores.extend(token_logprobs(logits[: targets.shape[0]], targets, score_top))
        last = logits[-1]
    return last, scores


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
    logprobs: int | None = None,
    echo: bool = False,
    prefill_chunk: int | None = None,
    prompt_lookup: int = 0,
) -> Iterator[object]:
    """Prefill ``input_ids`` ([1, T]) into ``cache``, then decode token by token, yielding events.

    ``prompt_lookup`` > 0: prompt-lookup decoding (greedy only): up to that many draft tokens copied from the
    text so far are verified in one forward call (``speculative.PromptLookup``); the tokens are greedy
    decoding's."""
    seq = Sequence(model, tokenizer, input_ids, cache, run=run, kv_policy=kv_policy, cache_mode=cache_mode,
                   max_new_tokens=max_new_tokens, sampling=sampling, eos_ids=eos_ids, stop=stop,
                   collect_logits=collect_logits, cancel=cancel, report=report, logprobs=logprobs, echo=echo,
                   prefill_chunk=prefill_chunk)
    drafts = PromptLookup(prompt_lookup, seq, eos_ids, _forward) if prompt_lookup else None
    yield from seq.start()
    if drafts is not None:
        cache.activate_past_recording()  # from here every call can be cropped; its rows are decode rows
    while not seq.done:
        yield from (seq.step() if drafts is None else drafts.step(cache))
        if seq.next_token is not None:
            if drafts is not None:
                drafts.feed(model, cache)
                continue
            # inference mode per forward call, not around the loop: a generator suspended inside a `with` block
            # leaves the thread's grad mode to whichever interleaved stream (lockstep) exits last
            t0 = time.perf_counter()
            logits = _forward(model, torch.tensor([[seq.next_token]], device=seq.device), cache).logits[0, -1]
            seq.feed(logits, time.perf_counter() - t0)


@torch.inference_mode()
def _forward(model, ids: torch.Tensor, cache, **kwargs):
    return model(input_ids=ids, cache=cache, use_cache=True, **kwargs)


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
