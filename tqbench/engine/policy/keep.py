"""Token eviction's policy values: ``keep`` (a fraction of the evictable rows, or a whole number of rows per KV
head), ``score`` (how rows are ranked), ``window`` (the observation window of last queries) and ``every``
(decode-time re-eviction period). The one rule for how many rows a layer holds is ``kept_rows``; the store
(``cache.evict``) and the byte estimate both call it."""

from __future__ import annotations

import math

#: scores a policy can rank rows by (docs/policies.md says which published method each follows)
SCORES = ("snapkv", "keynorm", "expected", "h2o", "tova")
NO_EVICTION = 1.0
#: how a layer's kept rows are shared between its KV heads: ``uniform`` (every head keeps ``kept_rows``), ``ada``
#: (AdaKV: the heads' scores ranked together, the layer keeps ``heads * kept_rows`` rows, each head at least
#: ``ada_floor`` of the uniform share of the rows between its sinks and its protected tail)
HEAD_BUDGETS = ("uniform", "ada")
ADA_FLOOR = 0.2  # kvpress AdaKVPress's alpha_safeguard default

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


def check_heads(heads, ada_floor) -> None:
    """``heads`` and ``ada_floor`` checked (a one-line error that says what to use)."""
    if heads not in HEAD_BUDGETS:
        raise ValueError(f"heads={heads!r} is invalid: use uniform (every KV head keeps the same rows) or ada "
                         "(AdaKV: the layer's kept rows shared between its heads by their scores)")
    if isinstance(ada_floor, bool) or not isinstance(ada_floor, (int, float)) or not 0 <= ada_floor <= 1:
        raise ValueError(f"ada_floor={ada_floor!r} is invalid: use a fraction 0 <= f <= 1 of the uniform share "
                         f"each KV head keeps at least (default {ADA_FLOOR})")


def ada_floor_rows(target: int, head: int, tail: int, ada_floor: float) -> int:
    """The rows between the sinks and the protected tail that every KV head keeps at least under ``heads=ada``:
    ``floor(ada_floor * share)`` of the uniform share ``share = target - head - tail``, and at least one when the
    share has one (so every head's store packs rows, and holds its codec state, exactly when a uniform head's
    would: the layer's bytes stay a pure function of its row count, ``estimate.ragged_store_parts``)."""
    share = max(0, target - head - tail)
    return max(math.floor(ada_floor * share), min(share, 1))


def fmt_keep(keep) -> str:
    return str(keep)
