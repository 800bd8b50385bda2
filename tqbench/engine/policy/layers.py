"""Layer selectors: ``first2``, ``last8``, ``3``, ``-1``, ``4-7``, joined with ``+`` (``first2+last2``); and by kind in
a hybrid model: ``sliding`` (its sliding-window layers) and ``global`` (its full-attention layers), both empty in a
model with no sliding layers (there every layer is global and none is set apart: ``all`` names them)."""

from __future__ import annotations

import re

_SELECTOR_HELP = ("use first<N>, last<N>, an index (negative counts from the end), a range a-b, sliding or global "
                  "(the layer kinds of a hybrid model), joined with '+'")
_TOKEN = re.compile(r"^(first(\d+)|last(\d+)|(-?\d+)|(\d+)-(\d+)|all|none|sliding|global)$")
SLIDING, GLOBAL = "sliding_attention", "full_attention"  # transformers' layer_types


def kind_layers(kind: str, layer_types) -> set[int]:
    """``sliding`` / ``global``: the layers of that kind in a model with sliding layers (else none)."""
    types = list(layer_types or ())
    if SLIDING not in types:
        return set()
    want = SLIDING if kind == "sliding" else GLOBAL
    return {i for i, t in enumerate(types) if t == want}


def validate_selector(text: str) -> str:
    """Check the syntax of a selector (no layer count needed); return it normalised."""
    text = text.strip().lower()
    if not text:
        raise ValueError(f"empty layer selector: {_SELECTOR_HELP}")
    for part in text.split("+"):
        if not _TOKEN.match(part.strip()):
            raise ValueError(f"bad layer selector part '{part}': {_SELECTOR_HELP}")
    return "+".join(p.strip() for p in text.split("+"))


def select_layers(text: str, num_layers: int, layer_types=None) -> set[int]:
    """Resolve a selector against a model with ``num_layers`` layers (and its ``layer_types``, which ``sliding`` and
    ``global`` read; without them both are empty). Unknown indices raise."""
    out: set[int] = set()
    for part in validate_selector(text).split("+"):
        m = _TOKEN.match(part)
        assert m is not None
        if part == "all":
            out.update(range(num_layers))
        elif part == "none":
            continue
        elif part in ("sliding", "global"):
            out.update(kind_layers(part, layer_types))
        elif m.group(2) is not None:
            out.update(range(min(int(m.group(2)), num_layers)))
        elif m.group(3) is not None:
            out.update(range(max(num_layers - int(m.group(3)), 0), num_layers))
        elif m.group(4) is not None:
            idx = int(m.group(4))
            if not -num_layers <= idx < num_layers:
                raise ValueError(
                    f"layer index {idx} is out of range for a model with {num_layers} layers "
                    f"(valid: 0..{num_layers - 1} or -{num_layers}..-1)"
                )
            out.add(idx % num_layers)
        else:
            a, b = int(m.group(5)), int(m.group(6))
            if a > b or b >= num_layers:
                raise ValueError(
                    f"layer range {a}-{b} is invalid for a model with {num_layers} layers (valid: 0..{num_layers - 1})"
                )
            out.update(range(a, b + 1))
    return out
