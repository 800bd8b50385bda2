"""The bounds of a bits-per-element budget (and the rule of a minimum decode speed), known without a model: one definition that the CLI, the workbench's
allocation panel and the solver check (imports the codec registry only, so a front end checks it before a model
loads)."""

from __future__ import annotations

from collections.abc import Iterable

from tqbench.engine.codecs import canonical_spec, nominal_bits
from tqbench.engine.request import RequestError

REFERENCE = "turbo4"  # the uniform fused policy the default minimum decode speed is stated by
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


def resolve_min_speed(value) -> tuple[float | None, str]:
    """A minimum decode speed (tokens/s relative to a dense cache at the stated context) as given: None or
    ``"none"`` (no minimum), ``"reference"`` / ``"turbo4"`` (no slower than uniform turbo4 fused, as predicted: its
    ratio is known once the decode costs are) or a ratio above 0. Returns (ratio or None, source: ``"none"``,
    ``"reference"`` or ``"given"``); ``RequestError`` (field ``min_speed``) for anything else."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "none"):
        return None, "none"
    if isinstance(value, str) and value.strip().lower() in ("reference", REFERENCE):
        return None, "reference"
    why = f"give a ratio of decode tokens/s to a dense cache above 0 (e.g. 0.8), {REFERENCE} or none"
    try:
        ratio = float(value)
    except (TypeError, ValueError):
        raise RequestError("min_speed", value, why) from None
    if isinstance(value, bool) or not 0 < ratio < float("inf"):
        raise RequestError("min_speed", ratio, why)
    return ratio, "given"
