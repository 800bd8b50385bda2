"""The suite's tasks, their metrics and the rules on what a run may ask for. Torch-free: front ends check input
here before a model loads.

Metrics are RULER's (``string_match_all``: the fraction of references the answer contains; ``string_match_part``:
1 when it contains any of them; case-insensitive); a task's score is 100 x the mean over its samples.
``chance`` is what a model with no access to the context (or guessing among what the context offers) would score,
in points, and how that figure was reached (docs/validation.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tqbench.constants import DEFAULT_TASK_SAMPLES
from tqbench.engine.request import RequestError

SUITE = "tqbench-ruler"
#: bump when a prompt, a task's size or a metric changes: cached baseline answers of another version are not used
SUITE_VERSION = 1
CONTEXTS = (2048, 4096, 8192)
CONTEXT_CHOICES = (1024, *CONTEXTS)  # what a front end offers (1024: a quick look, below the sized lengths)
DEFAULT_SAMPLES = DEFAULT_TASK_SAMPLES  # one definition, in tqbench.constants (every front end)
MAX_SAMPLES = 64
#: how a compressed cache meets the question: ``agnostic`` (the context is compressed once, before any question;
#: the question is appended to the compressed cache: prefix caching, multi-turn chat, RAG; kvpress reports it first)
#: or ``aware`` (the whole prompt, question included, is compressed: the scores see what will be asked)
PROTOCOLS = ("agnostic", "aware")
Z95 = 1.959964  # the normal quantile of a two-sided 95% interval


def check_protocols(value) -> tuple[str, ...]:
    """``agnostic``, ``aware``, ``both`` or a comma list (text or a list); in ``PROTOCOLS`` order."""
    items = value.split(",") if isinstance(value, str) else list(value or ())
    items = [str(p).strip().lower() for p in items if str(p).strip()]
    if "both" in items:
        items = [*PROTOCOLS]
    bad = [p for p in items if p not in PROTOCOLS]
    if bad or not items:
        raise RequestError("protocol", value, "give agnostic (the context compressed before the question), aware "
                                              "(the question inside the compressed prompt) or both")
    return tuple(p for p in PROTOCOLS if p in items)


def interval95(scores: list[float]) -> tuple[float, float]:
    """The Wilson score interval (95%) of the mean of per-sample scores in [0, 1], in points: an answer's score is
    a success fraction, and Wilson's interval stays inside [0, 100] and is not empty at 0% or 100% (n = 3 at 100%:
    43.9-100). ``(0, 100)`` for no samples."""
    n = len(scores)
    if n == 0:
        return 0.0, 100.0
    p = sum(scores) / n
    z2 = Z95 * Z95
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = Z95 * ((p * (1 - p) / n + z2 / (4 * n * n)) ** 0.5) / (1 + z2 / n)
    return round(100 * max(0.0, centre - half), 2), round(100 * min(1.0, centre + half), 2)


def string_match_all(answer: str, references: tuple[str, ...]) -> float:
    a = answer.lower()
    return sum(r.lower() in a for r in references) / len(references)


def string_match_part(answer: str, references: tuple[str, ...]) -> float:
    a = answer.lower()
    return float(max(r.lower() in a for r in references))


METRICS: dict[str, Callable[[str, tuple[str, ...]], float]] = {
    "string_match_all": string_match_all, "string_match_part": string_match_part}


@dataclass(frozen=True)
class TaskSpec:
    name: str
    what: str  # what it tests, in a few words
    metric: str  # a METRICS key
    max_new_tokens: int
    min_context: int
    chance: float  # points
    chance_note: str
    default: bool  # in the suite when no tasks are named (sized for the default 135M model: docs/validation.md)
    builder: str  # a ``generate`` function: (tokenizer, rng, filler length, index, n) -> (user text, references, answer prefix)
    default_max_context: int | None = None  # in the default set only up to this context (None: at every context)

    @property
    def build(self) -> Callable:
        from tqbench.engine.tasks import generate

        return getattr(generate, self.builder)

    def score(self, answer: str, references: tuple[str, ...]) -> float:
        return METRICS[self.metric](answer, references)


TASKS: dict[str, TaskSpec] = {t.name: t for t in (
    TaskSpec("niah_single", "one key-value needle in essay text, retrieve its value", "string_match_all", 16, 512,
             0.0, "a 7-digit number: guessing scores ~0", True, "build_niah_single"),
    TaskSpec("niah_multikey", "four key-value needles, retrieve the value of one key", "string_match_all", 16, 512,
             25.0, "copying one of the 4 numbers in the context at random scores 25", True, "build_niah_multikey",
             2048),  # the default model is at chance from 4K (docs/validation.md): left out of the default set there
    TaskSpec("niah_multivalue", "two values under one key, retrieve both", "string_match_all", 24, 512,
             0.0, "7-digit numbers: guessing scores ~0", True, "build_niah_multivalue"),
    TaskSpec("variable_tracking", "a chain of 3 variable assignments in noise, list every variable holding "
             "a value", "string_match_all", 24, 512, 0.0,
             "5-letter random names: guessing scores ~0 (naming the one variable set to the value directly: 33)",
             False, "build_variable_tracking"),
    TaskSpec("common_words", "the 3 most frequent words (30 times each, the rest once) of a long numbered list",
             "string_match_all", 24, 512, 0.0,
             "3 random words of the list: 3 x 3/V, under 1 point at 2K (V > 300 distinct words)",
             False, "build_common_words"),
    TaskSpec("qa", "answer a question about one shipped paragraph among distractor paragraphs",
             "string_match_part", 16, 1024, 0.0,
             "short factual answers named only in the gold paragraph: guessing scores ~0",
             False, "build_qa"),
)}


def check_tasks(names: list[str] | None, context: int, samples: int, max_context: int | None = None,
                model: str = "the model") -> list[TaskSpec]:
    """The tasks asked for (None: the default set at ``context``, ``TaskSpec.default``), checked against ``context`` and ``samples``; ``max_context`` (the model's,
    when known) bounds the context. A ``RequestError`` names the field (tasks, context, samples) and what to give."""
    if names is not None:
        unknown = [n for n in names if n not in TASKS]
        if unknown or not names:
            raise RequestError("tasks", ",".join(names), f"unknown task {', '.join(unknown) or '(none given)'}: "
                               f"choose from {', '.join(TASKS)}")
    tasks = [TASKS[n] for n in names] if names else [
        t for t in TASKS.values() if t.default and (t.default_max_context is None or context <= t.default_max_context)]
    if isinstance(samples, bool) or not isinstance(samples, int) or not 1 <= samples <= MAX_SAMPLES:
        raise RequestError("samples", samples, f"give 1 to {MAX_SAMPLES} samples per task")
    short = [t.name for t in tasks if context < t.min_context]
    if short:
        need = max(TASKS[n].min_context for n in short)
        raise RequestError("context", context, f"too short for {', '.join(short)}: give at least {need} tokens "
                           "(or leave those tasks out)")
    if max_context and context > max_context:
        raise RequestError("context", context, f"above {model}'s maximum of {max_context} tokens: give at most "
                           f"{max_context}")
    return tasks
