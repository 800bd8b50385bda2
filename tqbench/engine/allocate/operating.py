"""The allocator's operating point where fixed bytes are large: which rotation it pays for, the transforms it fits
itself, and the uniform policy of the same bytes its verified answer is compared with.

- ``choose_rotation``: a dense QR rotation is stored as ``d x d`` fp32 (262,144 bytes for head_dim 256, counted once
  per kind and seed); the randomized Hadamard (``d`` random signs and the fixed Walsh-Hadamard matrix) is ``d / 8``
  bytes. Where the QR rotation would take more than ``ROTATION_SHARE`` of the budget at the stated context (and the
  head dim is a power of two, ``HADAMARD_MIN_DIM`` or more), the allocator measures and solves with ``rotation=hadamard`` and says so. Measured on
  Gemma-3 270M K/V (``benchmarks/rotation_distortion.py``, docs/allocation.md): the same score and output errors as
  QR within a few percent at 1-4 bits.
- ``own_transforms``: a model without a fitted ``pcaq`` key transform (the shipped one is SmolLM2's) gets one fitted
  on the calibration mix (``calibrate.fit_transforms``), cached per model fingerprint in the user cache folder, so
  the calibrated keys are among the allocator's choices; its time is the report's ``calibrate`` phase.
- ``uniform_of_bytes``: the uniform policy (one turbo width for every K and V, the allocation's protection) with the
  most bytes not above the allocation's, verified beside it; ``uniform_warning`` when the allocation's verified KL
  is more than ``UNIFORM_FAR`` times the uniform's on the same text.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import replace
from pathlib import Path

from tqbench.engine.cache.estimate import estimate_kv
from tqbench.engine.codecs.rotation import rotation_bytes
from tqbench.engine.policy.spec import Policy

#: the QR rotation's share of the budget bytes above which the allocator pays for the Hadamard one instead
ROTATION_SHARE = 0.02
ROTATION_CHOICES = ("auto", "qr", "hadamard")
#: ``auto`` picks the Hadamard rotation from this head dim up (measured equal or better than QR at 256; a smaller
#: Walsh-Hadamard mixes coarser and is not measured, so QR stays there)
HADAMARD_MIN_DIM = 128
#: uniform policies compared with (each K and V at one width)
UNIFORM_CODECS = ("turbo1", "turbo1.5", "turbo2", "turbo2.5", "turbo3", "turbo3.5", "turbo4", "q8_0")
#: the allocation's verified KL over the uniform's above which the report warns
UNIFORM_FAR = 1.5


def choose_rotation(rotation: str, base: Policy, geometry, budget_bits: float, context: int) -> tuple[Policy, str | None]:
    """``base`` with the rotation the allocation uses and a note saying why (None when nothing was decided)."""
    if rotation not in ROTATION_CHOICES:
        raise ValueError(f"rotation {rotation!r} is invalid: auto (hadamard where the QR rotation's bytes weigh), "
                         "qr or hadamard")
    if rotation != "auto":
        return replace(base, rotation=rotation), None
    if base.rotation != "qr":
        return base, None
    d = geometry.head_dim
    if d & (d - 1) or d < HADAMARD_MIN_DIM:
        return base, None
    from tqbench.engine.allocate.solver import budget_bytes

    qr = rotation_bytes(geometry.head_dim, "qr") + rotation_bytes(geometry.v_dim, "qr")  # K's seed and V's
    budget = budget_bytes(geometry, budget_bits, context, base)
    if qr <= ROTATION_SHARE * budget:
        return base, None
    return replace(base, rotation="hadamard"), (
        f"rotation=hadamard: QR rotations for head_dim {d} (K's and V's) are {qr:,} bytes, {qr / budget:.0%} of the "
        f"{budget:,}-byte budget at {context} tokens; the randomized Hadamard stores {rotation_bytes(d, 'hadamard')} "
        "bytes per role and quantizes as well (docs/allocation.md)")


def transforms_cache_path(engine) -> Path:
    from tqbench.engine.models.resolve import cache_dir

    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(str(engine.name)).stem)[:60]
    return cache_dir() / "transforms" / f"{stem}-{engine.loaded.fingerprint}.safetensors"


def own_transforms(engine, on_event=None, cancel=None, max_tokens: int = 1024) -> tuple[str, bool, float]:
    """(path of this model's fitted transforms, whether they were fitted now, CPU seconds): read from the user
    cache when fitted before, else fitted on the calibration mix (``max_tokens`` of each text, at most the model's
    context) and stored there."""
    path = transforms_cache_path(engine)
    if path.is_file():
        return str(path), False, 0.0
    from tqbench.engine.calibrate import fit_transforms
    from tqbench.engine.codecs.transforms_file import save_transforms

    c0 = time.process_time()
    tr = fit_transforms(engine, max_tokens=max(16, min(max_tokens, engine.max_context - 1)), on_event=on_event,
                        cancel=cancel)
    os.makedirs(path.parent, exist_ok=True)
    save_transforms(tr, path)
    return str(path), True, time.process_time() - c0


def uniform_of_bytes(alloc, base: Policy, geometry, context: int) -> Policy | None:
    """The uniform policy with the most bytes at ``context`` not above the allocation's (None: none fits)."""
    best, best_bytes = None, -1
    for spec in UNIFORM_CODECS:
        pol = replace(base, k=spec, v=spec, sink=alloc.policy.sink, recent=alloc.policy.recent,
                      srecent=alloc.policy.srecent, protect="",
                      overrides=(), keep=1.0, name=f"uniform-{spec}")
        try:
            nbytes = estimate_kv(pol, geometry, context).total_bytes
        except ValueError:
            continue
        if best_bytes < nbytes <= alloc.estimate.total_bytes:
            best, best_bytes = pol, nbytes
    return best


def uniform_warning(point, uniform_point) -> str | None:
    """A warning line when the allocation's verified KL is far above the uniform policy's on the same text."""
    if point is None or uniform_point is None:
        return None
    if point.kl_mean <= UNIFORM_FAR * uniform_point.kl_mean:
        return None
    return (f"the allocation's verified KL on {point.text} is {point.kl_mean:.4f}, "
            f"{point.kl_mean / max(uniform_point.kl_mean, 1e-12):.1f}x that of the uniform policy of no more bytes "
            f"({uniform_point.kv_policy}, {uniform_point.bits_per_element:.3f} bits/element: KL "
            f"{uniform_point.kl_mean:.4f}): the calibration cells did not predict this text; prefer the uniform "
            "policy, raise the budget or calibrate on text like it")


def unaffordable(specs, kspecs, granularity: str, base: Policy, geometry, budget_bits: float,
                 context: int) -> dict[str, list[str]]:
    """Per role, the choices that no unit can take within the budget: their bytes over the unit's cheapest choice
    exceed what the budget leaves once every unit holds its cheapest choice (the fixed windows and the cheapest
    choices' shared objects counted). Exact: such a cell could never be in a solution, so it is not measured."""
    from tqbench.engine.allocate.sensitivity import SensitivityTable, allocatable_layers
    from tqbench.engine.allocate.solver import _shared, budget_bytes, fixed_bytes, unit_bytes

    layers = allocatable_layers(base, geometry)
    if not layers:
        return {}
    allc = list(dict.fromkeys([*kspecs, *specs]))
    probe = SensitivityTable(layers, allc, heads=list(range(geometry.kv_heads)) if granularity == "head" else None,
                             role_codecs={"k": list(kspecs), "v": list(specs)})
    ub = unit_bytes(probe, base, geometry, context)
    cheapest = {u: min(row, key=row.__getitem__) for u, row in ub.items()}
    slack = (budget_bytes(geometry, budget_bits, context, base) - fixed_bytes(probe, base, geometry, context)
             - _shared(base, {(u[1], c) for u, c in cheapest.items()}, geometry)
             - sum(ub[u][c] for u, c in cheapest.items()))
    out: dict[str, list[str]] = {}
    for role in ("k", "v"):
        units = [u for u in ub if u[1] == role]
        for c in probe.choices(role):
            if units and all(ub[u][c] - ub[u][cheapest[u]] > slack for u in units):
                out.setdefault(role, []).append(c)
    return out
