"""Token eviction's policy values: ``keep`` (a fraction of the evictable rows, or a whole number of rows per KV
head), ``score`` (how rows are ranked), ``window`` (the observation window of last queries) and ``every``
(decode-time re-eviction period). The one rule for how many rows a layer holds is ``kept_rows``; the store
(``cache.evict``) and the byte estimate both call it."""

from __future__ import annotations

import math

#: scores a policy can rank rows by (docs/policies.md says which published method each follows)
SCORES = ("snapkv", "keynorm", "expected", "h2o", "tova")
NO_EVICTION = 1.0

_KEEP_HELP = "use a fraction 0 < f <= 1 of the evictable rows (e.g. 0.5) or a whole number of rows per KV head (e.g. 1024)"


def parse_keep(value) -> float | int:
    """A keep value from text (``"0.5"``, ``"1024"``) or a file (float or int); checked."""
    if isinstance(value, bool):
        raise ValueError(f"keep={value!r} is invalid: {_KEEP_HELP}")
    if isinstance(value, str):
        text = value.strip()
        try:
            value = int(text) if text.isdigit() else float(text)
        except ValueError:
            raise ValueError(f"keep={text!r} is invalid: {_KEEP_HELP}") from None
    return check_keep(value)


def check_keep(value) -> float | int:
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 1:
            raise ValueError(f"keep={value!r} is invalid: {_KEEP_HELP}")
        return value
    if isinstance(value, float) and math.isfinite(value) and 0 < value <= 1:
        return value
    raise ValueError(f"keep={value!r} is invalid: {_KEEP_HELP}")


def evicts(keep) -> bool:
    """Whether a keep value can evict anything (a fraction below 1, or a row count)."""
    return keep is not None and not (isinstance(keep, float) and keep >= 1.0)


def protected_rows(seen: int, sink: int, window: int, recent: int) -> tuple[int, int]:
    """(sink rows, tail rows) never evicted after ``seen`` tokens: the first ``sink``, the last max(window,
    recent) (the observation window and the full-precision recent rows)."""
    head = min(sink, seen)
    return head, min(seen - head, max(window, recent))


def kept_rows(seen: int, keep, sink: int, window: int, recent: int) -> int:
    """How many rows each KV head holds right after an eviction at ``seen`` tokens: the protected sinks and
    tail, plus ``floor(keep * middle)`` of the ``middle`` rows between them (a fraction) or as many as bring the
    head to ``keep`` rows (a count; the protected rows are kept even beyond it). Grows by at most one row per
    token, so rows added after an eviction never fall below the next eviction's budget."""
    if not evicts(keep):
        return seen
    head, tail = protected_rows(seen, sink, window, recent)
    middle = seen - head - tail
    if isinstance(keep, int):
        return head + tail + max(0, min(middle, keep - head - tail))
    return head + tail + math.floor(keep * middle)


def held_rows(seen: int, prefill: int, keep, sink: int, window: int, recent: int, every: int) -> int:
    """Rows each KV head of an evicting layer holds after ``seen`` tokens, ``prefill`` of them in prefill calls
    (evicted at the end of each), the rest decoded one token per call; with ``every`` > 0 the decode rows are
    evicted again every ``every`` decoded tokens."""
    prefill = min(prefill, seen)
    if not evicts(keep) or prefill == 0:
        return seen
    last = prefill
    if every > 0:
        last = prefill + (seen - prefill) // every * every
    return kept_rows(last, keep, sink, window, recent) + (seen - last)


def fmt_keep(keep) -> str:
    return str(keep)
