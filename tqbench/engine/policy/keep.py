"""Token eviction's policy values: ``keep`` (a fraction 0 < f <= 1 of the evictable rows, ``keep=1`` being every
row; a row count per KV head written with its unit, ``keep=512rows``; or one fraction per KV head ``F0|F1|...``: a
per-head keep list), ``score`` (how rows are ranked), ``window`` (the observation window of last queries) and ``every``
(decode-time re-eviction period). The one rule for how many rows a layer holds is ``kept_rows``; the store
(``cache.evict``) and the byte estimate both call it."""

from __future__ import annotations

import math

#: scores a policy can rank rows by (docs/policies.md says which published method each follows)
SCORES = ("snapkv", "keynorm", "expected", "h2o", "tova", "kvzip")
NO_EVICTION = 1.0
#: how a layer's kept rows are shared between its KV heads: ``uniform`` (every head keeps ``kept_rows``), ``ada``
#: (AdaKV: the heads' scores ranked together, the layer keeps ``heads * kept_rows`` rows, each head at least
#: ``ada_floor`` of the uniform share of the rows between its sinks and its protected tail)
HEAD_BUDGETS = ("uniform", "ada")
#: where a keep fraction is a budget: ``layer`` (every evicting layer keeps ``kept_rows`` per KV head, shared by
#: ``heads``), ``global`` (kvpress ``KVzipPress(layerwise=False)``: the middle rows of every evicting layer and KV
#: head ranked together, the same total kept, each layer and head its own count: ``evict.global_budget``)
BUDGETS = ("layer", "global")
#: scores whose values exist for every layer before the prefill (a context pass): the ones ``budget=global`` can rank
#: across layers (``scores.Score.context_pass``; a test checks the two agree)
CONTEXT_PASS_SCORES = ("kvzip",)
ADA_FLOOR = 0.2  # kvpress AdaKVPress's alpha_safeguard default

_KEEP_HELP = ("use a fraction 0 < f <= 1 of the evictable rows (e.g. 0.5; 1 keeps every row), a row count per KV "
              "head with its unit (e.g. 512rows), or one fraction per KV head (e.g. 0.5|1|0.25)")
#: what the eviction keys mean, in kvpress's terms too: the one text every front end's help shows (CLI ``--help`` of
#: the commands that take a policy; docs/policies.md says the same)
EVICTION_HELP = ("Eviction: keep=F keeps a fraction 0<F<=1 of the evictable rows per KV head (keep=1: every row; "
                 "kvpress compression_ratio=r is keep=1-r), keep=512rows a row count per KV head (a bare keep=512 "
                 "is refused as ambiguous), keep=0.5|1|0.25 one fraction per KV head; chunk=8 keeps or evicts rows "
                 "in chunks of 8 positions (kvpress ChunkKVPress(chunk_length=8)); demote=turbo2 keeps the evicted "
                 "rows at a cheaper codec instead of dropping them; budget=global (with score=kvzip) ranks the rows of "
                 "every layer and KV head together, as kvpress KVzipPress's default (layerwise=False).")
#: separates a per-head keep list's entries (as a per-KV-head codec list's: ``codecs.HEAD_SEP``)
KEEP_SEP = "|"
#: the unit a row count is written with (``keep=512rows``): a bare whole number above 1 is refused as ambiguous
ROWS_UNIT = "rows"
_LIST_HELP = "a per-head keep list is one fraction 0 < f <= 1 per KV head, in head order (e.g. 0.5|1|0.25)"


class Rows(int):
    """A keep value that is a row count per KV head (``keep=512rows``), never equal to a fraction: ``Rows(1)`` keeps
    one row where ``1.0`` keeps every row, so the two compare unequal and write differently (``fmt_keep``)."""

    def __new__(cls, n: int) -> Rows:
        return super().__new__(cls, n)

    def __eq__(self, other) -> bool:
        return isinstance(other, Rows) and int(self) == int(other)

    def __ne__(self, other) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        return hash((ROWS_UNIT, int(self)))

    def __repr__(self) -> str:
        return f"Rows({int(self)})"

    def __str__(self) -> str:
        return f"{int(self)}{ROWS_UNIT}"


def _ambiguous(n) -> ValueError:
    return ValueError(f"keep={n} is ambiguous: write keep={n}{ROWS_UNIT} for a row count per KV head or keep=0.5 for "
                      "a fraction of the rows")


def parse_keep(value) -> float | Rows | tuple[float, ...]:
    """A keep value from text (``"0.5"``, ``"1"``, ``"512rows"``, ``"0.5|1|0.25"``) or a file (a fraction, the
    text ``"512rows"``, a list of fractions); checked. A per-head list comes back as a tuple of floats, or as its one
    fraction when every entry is the same (so a layer whose heads all keep the same fraction is a uniform layer)."""
    if isinstance(value, (list, tuple)) or (isinstance(value, str) and KEEP_SEP in value):
        return _parse_head_keeps(value)
    if isinstance(value, str):
        text = value.strip().lower()
        if text.endswith(ROWS_UNIT) and not isinstance(value, Rows):
            digits = text.removesuffix(ROWS_UNIT).strip()
            if not digits.isdigit() or int(digits) < 1:
                raise ValueError(f"keep={value.strip()!r} is invalid: a row count is a whole number >= 1 with its "
                                 f"unit, e.g. 512{ROWS_UNIT}")
            return Rows(int(digits))
        try:
            value = int(text) if text.isdigit() else float(text)
        except ValueError:
            raise ValueError(f"keep={value.strip()!r} is invalid: {_KEEP_HELP}") from None
    return check_keep(value)


def _parse_head_keeps(value) -> float | tuple[float, ...]:
    text = value if isinstance(value, str) else KEEP_SEP.join(str(v) for v in value)
    entries = value.split(KEEP_SEP) if isinstance(value, str) else list(value)
    out = []
    for e in entries:
        f = e.strip() if isinstance(e, str) else e
        try:
            f = float(f) if not isinstance(f, bool) and f != "" else None
        except (TypeError, ValueError):
            f = None
        if f is None or not math.isfinite(f) or not 0 < f <= 1:
            raise ValueError(f"keep={text!r} is invalid: entry {e!r} is not a fraction: {_LIST_HELP}")
        out.append(f)
    if len(out) < 2:
        raise ValueError(f"keep={text!r} is invalid: {_LIST_HELP}")
    return out[0] if len(set(out)) == 1 else tuple(out)


def check_keep(value) -> float | Rows | tuple[float, ...]:
    """A keep value as a ``Policy`` holds it: a fraction (a whole 1 is the fraction 1.0: every row), a ``Rows``
    count, or a per-head list of fractions. A bare whole number above 1 is refused as ambiguous (``_ambiguous``)."""
    if isinstance(value, (list, tuple)):
        return _parse_head_keeps(value)
    if isinstance(value, Rows):
        if value < 1:
            raise ValueError(f"keep={value} is invalid: a row count is a whole number >= 1, e.g. 512{ROWS_UNIT}")
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        if value == 1:
            return 1.0
        if value > 1:
            raise _ambiguous(value)
        raise ValueError(f"keep={value!r} is invalid: {_KEEP_HELP}")
    if isinstance(value, float) and math.isfinite(value) and 0 < value <= 1:
        return value
    raise ValueError(f"keep={value!r} is invalid: {_KEEP_HELP}")


def check_keep_rows(keep, sink: int, window: int, recent: int, where: str = "keep") -> None:
    """A row count (``keep=512rows``) is at least the rows every KV head keeps anyway (the ``sink`` rows and the
    last max(``window``, ``recent``): ``protected_rows``); a smaller count would be silently raised to them."""
    if not isinstance(keep, Rows):
        return
    floor = sink + max(window, recent)
    if keep < floor:
        raise ValueError(f"{where}={keep} is below the {floor} rows every KV head keeps anyway (sink={sink} + "
                         f"max(window={window}, recent={recent})): give {where}={floor}{ROWS_UNIT} or more, a "
                         "fraction such as 0.5, or a smaller window/recent")


def evicts(keep) -> bool:
    """Whether a keep value can evict anything (a fraction below 1, or a row count; a per-head list: in any head)."""
    if isinstance(keep, tuple):
        return any(evicts(k) for k in keep)
    return keep is not None and not (isinstance(keep, float) and keep >= 1.0)


def is_head_keeps(keep) -> bool:
    """True for a per-head keep list (each KV head of the layer its own fraction: ragged per-head stores)."""
    return isinstance(keep, tuple)


def head_keeps(keep, kv_heads: int, layer: int | None = None) -> tuple:
    """The keep value of each of a layer's ``kv_heads`` KV heads; a per-head list checked against that count
    (the error names the layer and its KV heads)."""
    if not is_head_keeps(keep):
        return (keep,) * kv_heads
    if len(keep) != kv_heads:
        where = f"layer {layer} has" if layer is not None else "the model has"
        raise ValueError(f"keep={fmt_keep(keep)} lists {len(keep)} fractions but {where} {kv_heads} KV heads: give "
                         f"one fraction per KV head, in head order (F0|...|F{kv_heads - 1})")
    return keep


def protected_rows(seen: int, sink: int, window: int, recent: int) -> tuple[int, int]:
    """(sink rows, tail rows) never evicted after ``seen`` tokens: the first ``sink``, the last max(window,
    recent) (the observation window and the full-precision recent rows)."""
    head = min(sink, seen)
    return head, min(seen - head, max(window, recent))


def eviction_test_tokens(sink: int, window: int, recent: int) -> int:
    """The shortest prompt on which a validation tests eviction: twice the rows every KV head keeps anyway
    (``protected_rows``), so at least as many rows are evictable as protected. On a shorter prompt an eviction policy
    evicts a few rows at most, and what its tokens do says nothing about eviction."""
    return 2 * (sink + max(window, recent))


def kept_rows(seen: int, keep, sink: int, window: int, recent: int) -> int:
    """How many rows each KV head holds right after an eviction at ``seen`` tokens: the protected sinks and
    tail, plus ``floor(keep * middle)`` of the ``middle`` rows between them (a fraction) or as many as bring the
    head to ``keep`` rows (a count; the protected rows are kept even beyond it). Grows by at most one row per
    token, so rows added after an eviction never fall below the next eviction's budget."""
    if not evicts(keep):
        return seen
    head, tail = protected_rows(seen, sink, window, recent)
    middle = seen - head - tail
    if isinstance(keep, Rows):
        return head + tail + max(0, min(middle, int(keep) - head - tail))
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


def check_budget(budget, score: str, heads: str, keeps: tuple, every: int, demote, evicting: bool) -> None:
    """``budget`` checked against the policy's other eviction keys (``keeps``: its keep values, ``keep@`` ones
    included; ``demote``: whether any layer demotes); a one-line error that says what to use."""
    if budget not in BUDGETS:
        raise ValueError(f"budget={budget!r} is invalid: use layer (every layer keeps keep=F of its rows per KV head) "
                         "or global (the rows of every layer and KV head ranked together, kvpress KVzipPress)")
    if budget == "layer":
        return
    why = None
    if not evicting:
        why = "but this policy evicts nothing: set keep below 1 (e.g. keep=0.5)"
    elif score not in CONTEXT_PASS_SCORES:
        why = (f"which needs every layer's scores at once, before any layer evicts: score={score} scores a layer "
               f"while the prefill passes it; use score={'|'.join(CONTEXT_PASS_SCORES)}")
    elif heads != "uniform":
        why = "which already shares the rows between the heads: drop heads=ada"
    elif any(is_head_keeps(k) for k in keeps):
        why = "so it takes one keep value (a per-layer keep@ is fine), not a per-head keep list"
    elif every:
        why = "at the prefill's eviction point: drop every= (decoded rows are not ranked again)"
    elif demote:
        why = "and the demote tier does not follow it yet: drop demote= or use budget=layer"
    if why:
        raise ValueError(f"budget=global ranks the rows of every layer and KV head together, {why}")


def ada_floor_rows(target: int, head: int, tail: int, ada_floor: float) -> int:
    """The rows between the sinks and the protected tail that every KV head keeps at least under ``heads=ada``:
    ``floor(ada_floor * share)`` of the uniform share ``share = target - head - tail``, and at least one when the
    share has one (so every head's store packs rows, and holds its codec state, exactly when a uniform head's
    would: the layer's bytes stay a pure function of its row count, ``estimate.ragged_store_parts``)."""
    share = max(0, target - head - tail)
    return max(math.floor(ada_floor * share), min(share, 1))


def _fmt_fraction(f: float) -> str:
    return "1" if f == 1 else repr(float(f))


def fmt_keep(keep) -> str:
    """A keep value as the policy text writes it, read back equal by ``parse_keep``: ``0.5``, ``1`` (every row),
    ``512rows``, a per-head list ``0.5|1|0.25``."""
    if is_head_keeps(keep):
        return KEEP_SEP.join(_fmt_fraction(f) for f in keep)
    if isinstance(keep, Rows):
        return str(keep)
    return _fmt_fraction(float(keep))
