"""The bounds of a bits-per-element budget, known without a model: one definition that the CLI, the workbench's
allocation panel and the solver check (imports the codec registry only, so a front end checks it before a model
loads)."""

from __future__ import annotations

from collections.abc import Iterable

from tqbench.engine.codecs import canonical_spec, nominal_bits

DENSE_BITS = 16.0  # the fp16 cache a budget is stated against: at or above it there is nothing to allocate


def check_budget(budget_bits: float, codecs: Iterable[str] = ()) -> None:
    """Above the cheapest of ``codecs``' nominal bits (its norms or scales cost more, so that budget cannot fit;
    0 with no codecs) and below 16 (fp16 fits as it is); NaN is out. ``ValueError`` names the bounds."""
    codecs = list(codecs)
    cheap = min(codecs, key=nominal_bits) if codecs else None
    floor = nominal_bits(cheap) if cheap else 0.0
    if not floor < budget_bits < DENSE_BITS:
        lowest = f"{floor:g} (the cheapest codec, {canonical_spec(cheap)}, needs more)" if cheap else "0"
        raise ValueError(f"budget {budget_bits:g} bits/element is out of range: give a number above {lowest} and "
                         f"below {DENSE_BITS:g} (fp16 needs no allocation), e.g. 3.0")
