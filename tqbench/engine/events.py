"""Plain dataclasses the engine yields. Front ends (CLI, TUI, server) render them; none re-implements a loop.

Also the two halves of the long-job protocol (the rule itself is written once, in ``tqbench.engine.generate``):
``OnEvent`` / ``emit`` (progress) and ``CancelFlag`` / ``Cancelled`` / ``raise_if_cancelled`` (cancel).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

#: the progress callback every long job takes as ``on_event=``: it gets each event dataclass below
OnEvent = Callable[[Any], None]
#: the cancel flag every long job takes as ``cancel=``: checked every step, true = stop
CancelFlag = Callable[[], bool]


class Cancelled(Exception):
    """A long job's ``cancel()`` turned true: the job stops at its next step and returns nothing."""


def emit(on_event: OnEvent | None, event: object) -> None:
    """Pass ``event`` to the job's callback, if it has one."""
    if on_event is not None:
        on_event(event)


def raise_if_cancelled(cancel: CancelFlag | None, job: str) -> None:
    """Raise ``Cancelled("<job> cancelled")`` when the job's cancel flag is set."""
    if cancel is not None and cancel():
        raise Cancelled(f"{job} cancelled")


def eta_seconds(elapsed: float, done: float, total: float | None) -> float | None:
    """Seconds a job has left at its mean pace so far: ``elapsed`` seconds for ``done`` of ``total`` units. None
    before the first unit ends, or without a total. The one ETA rule every front end shows."""
    if total is None or done <= 0 or elapsed <= 0:
        return None
    return max(total - done, 0.0) * elapsed / done


def format_duration(seconds: float) -> str:
    """``42 s``, ``3 min 05 s``, ``1 h 12 min``: a duration as progress lines and ``--help`` texts say it."""
    s = max(int(round(seconds)), 0)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


def eta_text(elapsed: float, done: float, total: float | None) -> str:
    """``"about 3 min 05 s left"`` after the first unit, ``""`` before it (or without a total)."""
    left = eta_seconds(elapsed, done, total)
    return "" if left is None else f"about {format_duration(left)} left"


class PhaseEta:
    """The time left of a long job's current phase, for front ends that draw its events: a phase is an event's
    ``task`` name; a new name, or a count that starts again, is a new phase, whose pace starts where the previous
    phase's last unit ended (the job's start for the first). ``update`` returns ``eta_text`` for the phase."""

    def __init__(self, clock: Callable[[], float] | None = None) -> None:
        import time

        self.clock = clock or time.monotonic
        self.start = self.seen = self.phase_start = self.clock()
        self.phase: str | None = None
        self.done = 0.0
        self.new_phase = False

    def update(self, phase: str, done: float, total: float | None) -> str:
        now = self.clock()
        self.new_phase = phase != self.phase or done < self.done
        if self.new_phase and self.phase is not None:
            self.phase_start = self.seen
        self.phase, self.done, self.seen = phase, done, now
        if total is not None and done >= total:
            return ""
        return eta_text(now - self.phase_start, done, total)


@dataclass(frozen=True)
class GenerationStarted:
    run: str  # "baseline", "candidate" or a free label
    kv_policy: str
    cache_mode: str
    input_tokens: int


@dataclass(frozen=True)
class PrefillDone:
    run: str
    input_tokens: int
    seconds: float


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the distribution that produced (or, for a prompt token, predicted) it,
    and the ``top`` most likely tokens of that distribution as ``(token_id, logprob)``, best first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class PromptScored:
    """The prompt's tokens scored by the prefill (``echo``): entry i is token i+1's log-probability given
    tokens 0..i, read through the request's cache exactly as generation reads it; token 0 has none."""

    run: str
    first_token_id: int
    scores: tuple[TokenLogprob, ...]


@dataclass(frozen=True)
class TokenGenerated:
    run: str
    step: int  # 0-based index of the generated token
    token_id: int
    text_delta: str  # new complete characters (a partial multi-byte character is held back)
    step_seconds: float  # wall time of the forward call that produced this token
    top1_id: int  # argmax of the logits that produced this token (== token_id when greedy)
    logits: Any = field(default=None, repr=False)  # float32 vector when collect_logits=True
    logprob: TokenLogprob | None = None  # when the generation was asked for logprobs


@dataclass(frozen=True)
class GenerationFinished:
    run: str
    result: Any  # GenerationResult


@dataclass(frozen=True)
class PairStep:
    """One lockstep step of a baseline and a candidate run (either may have finished: None)."""

    step: int
    baseline: TokenGenerated | None
    candidate: TokenGenerated | None
    same_token: bool
    same_top1: bool
    kl: float | None  # KL(baseline || candidate) of this step's distributions, when logits were collected


@dataclass(frozen=True)
class Progress:
    """Generic progress for long work (model load, conversion, benchmarks)."""

    task: str
    done: float
    total: float | None = None
    message: str = ""


@dataclass(frozen=True)
class TeacherForcedStep(Progress):
    """Teacher-forced quality fed one more token through one run: ``task`` is the run ("baseline" or
    "candidate"), ``done`` the steps fed so far of ``total``. A ``Progress``, so a progress bar draws it as one."""

    kv_policy: str = ""  # the run's policy label ("dynamic-cache" for the dense baseline)


@dataclass(frozen=True)
class QKVCaptured:
    """``capture_qkv`` recorded Q/K/V of ``layers`` over ``tokens`` tokens."""

    layers: tuple[int, ...]
    tokens: int


@dataclass(frozen=True)
class CacheBytes:
    """What a run's KV cache holds after a step (``Engine.stream(..., track_bytes=True)``)."""

    run: str
    step: int
    tokens: int
    storage_bytes: int  # packed store + fp16 rows + shared objects
    resident_bytes: int  # what the cache mode keeps in memory during decode
    dense_fp16_bytes: int  # an fp16 cache for the same tokens


@dataclass(frozen=True)
class KeptTokens:
    """Which tokens each KV head of a run's evicting layers kept (``Engine.stream(..., track_kept=True)``),
    just before its ``GenerationFinished``: ``kept`` is a ``cache.evict.kept.KeptPositions``, ``token_ids`` the
    ids at positions ``0 .. kept.seen-1`` (the prompt, then the generated tokens fed back), ``texts`` each
    token decoded alone (special tokens shown; a character split over tokens shows as U+FFFD)."""

    run: str
    kept: Any
    token_ids: tuple[int, ...]
    texts: tuple[str, ...]


@dataclass(frozen=True)
class ValidationDone:
    """``validate`` finished; ``report`` is the ``ValidationReport``."""

    report: Any


@dataclass(frozen=True)
class CompareCell:
    """One (policy, prompt) cell of ``compare_policies`` is done."""

    policy: str
    prompt_index: int
    verdict: str
    token_match_ratio: float
    kl_mean: float | None


@dataclass(frozen=True)
class ScanLayerDone:
    """``scan`` finished one layer; ``row`` holds that layer's per-head metrics (JSON-safe)."""

    layer: int
    index: int  # position among the scanned layers
    total: int
    row: Any = field(default=None, repr=False)


@dataclass(frozen=True)
class NiahCell:
    """``needle_in_haystack`` scored one (policy, length, depth) cell."""

    policy: str
    length: int
    depth: float
    recalled: bool
    answer: str


@dataclass(frozen=True)
class SensitivityMeasured(Progress):
    """``allocate`` measured one (layer, role, codec) cell: the KL its quantization alone costs. A ``Progress``
    (``task`` "sensitivity", ``done`` of ``total`` cells), so a progress bar draws it as one; ``resumed`` when
    the cell came from the job's partial results file instead of a new measurement."""

    layer: int = 0
    role: str = ""
    codec: str = ""
    kl: float = 0.0
    resumed: bool = False
    head: int = -1  # the KV head at head granularity; -1: the whole layer
