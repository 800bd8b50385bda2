"""The family matrix's tiny models with every sliding window at 8 tokens, so short prompts cross it.

``--model tiny-mistral`` itself slides over 192 tokens (``FAMILIES``: long enough that a 2.5-bit budget fits, shorter
than ``allocate``'s 256-token calibration); the other sliding families' own windows are already 8.
"""

from __future__ import annotations

from tqbench.engine.models.families import FAMILIES, family_model

SHORT_WINDOW = 8


def short_window_model(family: str, **overrides):
    """``family_model(family, **overrides)`` with the sliding window (where the family has one) at ``SHORT_WINDOW``."""
    window = {"sliding_window": SHORT_WINDOW} if "sliding_window" in FAMILIES[family] else {}
    return family_model(family, **{**window, **overrides})
