"""Per-unit sensitivity: the KL that quantizing one layer's (or one KV head's) K or V alone costs.

The measure (a "one-unit chunk" proxy of teacher-forced KL, ``chunk.ChunkRunner``): prefill the calibration
sequences once with exact attention and keep the dense K/V; then, for each cell, replace one layer's K (or V)
history, or one KV head's rows of it, by what a ``KVStore`` under that codec gives back (sinks and the recent window
exact, the rest packed and dequantized, the codec calibrated on those rows as the cache does) and feed the next
``steps`` tokens of every sequence in one forward call, starting at the cell's layer (the layers below read exact
K/V). The cell's sensitivity is the mean KL(exact || candidate) of those next-token distributions
(``metrics.kl_rows``). With one sequence and 64 steps it ranked the 60 (layer, role) cells of SmolLM2 at turbo2 like
the teacher-forced one-layer run (Spearman 0.94; ``rank_correlation`` below).

Sliding-window layers: those the policy bypasses (``sliding=bypass``, and ``auto`` in a model that mixes sliding and
full layers: transformers' own bounded dense window, no tqbench codec) get no cells; their fixed fp16 window is
counted in the bytes. Those it compresses (``sliding=compress``, and ``auto`` when every layer slides) get cells like
any layer, read through a real window-bounded ``TQLayer`` whose every chunk query sees what one-token-at-a-time
decoding would (``ChunkRunner.sliding_candidate``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from tqbench.engine.allocate.chunk import ChunkRunner, quantized_rows
from tqbench.engine.events import CancelFlag, OnEvent, SensitivityMeasured, emit, raise_if_cancelled
from tqbench.engine.policy.spec import Policy

JOB = "allocate"
ROLES = ("k", "v")
#: choices whose cells are not measured: KL 0 (the cells' reference reads the model's own rows; fp16 storage of
#: fp32 rows differs from them by rounding alone)
EXACT = ("fp16", "fp32")
#: a wider choice measured only where the narrower one's cell is at least this KL; elsewhere its cell is taken as
#: the narrower one's (it can gain at most that much, and at equal KL and more bytes the solver never picks it)
BOUNDED = {"q8_0": ("turbo4", 1e-3)}

__all__ = ["ROLES", "SensitivityTable", "allocatable_layers", "cell_key", "measure_sensitivity", "quantized_rows",
           "rank_correlation", "sliding_repricer"]


def allocatable_layers(policy: Policy, geometry) -> list[int]:
    """The layers whose codecs an allocation under ``policy`` chooses: every layer but the sliding-window layers it
    bypasses (transformers' bounded dense window: no tqbench codec) and those its layer plan keeps fp16 whatever
    the codecs (``sliding=dense``; full-attention layers under ``bypass=global``). Choices offered for those would
    be overridden by the plan and their bytes miscounted."""
    probe = replace(policy, k="turbo4", v="turbo4", protect="", overrides=())  # lossy everywhere the plan allows
    plans = probe.plan(geometry.num_layers, list(geometry.layer_types) if geometry.layer_types else None)
    return [p.layer for p in plans if p.compressed]


def cell_key(layer: int, role: str, codec: str, head: int | None = None) -> str:
    """``L/role/codec`` (a whole layer) or ``L.h/role/codec`` (KV head ``h`` of layer ``L`` alone)."""
    return f"{layer}/{role}/{codec}" if head is None else f"{layer}.{head}/{role}/{codec}"


@dataclass
class SensitivityTable:
    """``kl[unit][codec]``: the measured KL of quantizing one unit alone with that codec. A unit is
    ``(layer, role)`` (layer granularity, ``heads`` None) or ``(layer, role, head)`` (head granularity)."""

    layers: list[int]
    codecs: list[str]
    kl: dict[tuple, dict[str, float]] = field(default_factory=dict)
    heads: list[int] | None = None
    role_codecs: dict[str, list[str]] | None = None  # the choices per role (None: ``codecs`` for both)
    bounded: list[str] = field(default_factory=list)  # cell keys taken from a narrower choice's (``BOUNDED``)

    def choices(self, role: str) -> list[str]:
        return list(self.role_codecs[role]) if self.role_codecs else list(self.codecs)

    def units(self) -> list[tuple]:
        if self.heads is None:
            return [(layer, role) for layer in self.layers for role in ROLES]
        return [(layer, role, h) for layer in self.layers for role in ROLES for h in self.heads]

    def get(self, layer: int, role: str, codec: str, head: int | None = None) -> float:
        return self.kl[(layer, role) if head is None else (layer, role, head)][codec]

    def to_rows(self) -> list[dict]:
        nan = float("nan")
        return [{"layer": u[0], "role": u[1], **({"head": u[2]} if len(u) == 3 else {}),
                 **{c: self.kl[u].get(c, nan) for c in self.codecs}} for u in self.units()]

    def as_tensor(self) -> torch.Tensor:
        """``[layers, 2 (k, v), codecs]`` (layer granularity) or ``[layers, 2, heads, codecs]`` float64 (the
        policy artifact's safetensors sidecar); NaN where a role has no such choice."""
        nan = float("nan")
        if self.heads is None:
            return torch.tensor([[[self.kl[(layer, r)].get(c, nan) for c in self.codecs] for r in ROLES]
                                 for layer in self.layers], dtype=torch.float64)
        return torch.tensor([[[[self.kl[(layer, r, h)].get(c, nan) for c in self.codecs] for h in self.heads]
                              for r in ROLES] for layer in self.layers], dtype=torch.float64)


def measure_sensitivity(
    engine,
    ids: torch.Tensor,
    prefill: int,
    codecs: list[str],
    policy: Policy,
    *,
    known: dict[str, float] | None = None,
    on_cell: Callable[[str, float], None] | None = None,
    on_event: OnEvent | None = None,
    cancel: CancelFlag | None = None,
    granularity: str = "layer",
    k_codecs: list[str] | None = None,
    runner: ChunkRunner | None = None,
) -> SensitivityTable:
    """Measure every cell on ``ids`` ([sequences, prefill + steps]): per (layer, role, codec) at layer
    granularity, per (layer, KV head, role, codec) at head granularity (only that head's rows quantized, the codec
    built for that head: ``heads=(h,)``).

    ``codecs``: the choices (``k_codecs``: other choices for K, e.g. with calibrated ``pcaq`` codecs). ``policy``
    supplies the token protection (sink, recent) and codec options. Cells already in ``known`` (``cell_key`` ->
    KL) are not measured again; ``on_cell(key, kl)`` after each new one. One ``SensitivityMeasured`` per cell;
    ``cancel`` is checked before each. ``runner``: a ``ChunkRunner`` on the same ids to reuse.
    """
    if ids.dim() != 2:
        raise ValueError(f"ids must be shaped [sequences, tokens], got {tuple(ids.shape)}")
    if prefill < 1 or ids.shape[1] - prefill < 1:
        raise ValueError(f"prefill={prefill} must leave at least one calibration step in {ids.shape[1]} tokens")
    if not codecs:
        raise ValueError("no codecs to measure: give at least one, e.g. turbo1,turbo2,turbo3,turbo4")
    if granularity not in ("layer", "head"):
        raise ValueError(f"granularity {granularity!r} is invalid: layer or head")
    known = dict(known or {})
    geo = engine.geometry
    layers = allocatable_layers(policy, geo)
    if not layers:
        raise ValueError(f"{engine.name}: policy {policy.to_string()!r} keeps every layer dense (sliding-window "
                         "layers bypassed or dense): there is nothing to allocate; use sliding=compress")
    role_codecs = {"k": list(k_codecs or codecs), "v": list(codecs)}
    allc = list(dict.fromkeys(role_codecs["k"] + role_codecs["v"]))
    heads = list(range(geo.kv_heads)) if granularity == "head" else None
    table = SensitivityTable(layers, allc, heads=heads,
                             role_codecs=role_codecs if role_codecs["k"] != role_codecs["v"] else None)
    cells = [(u, c) for u in table.units() for c in table.choices(u[1])]
    raise_if_cancelled(cancel, JOB)
    todo = [cell for cell in cells if cell_key(cell[0][0], cell[0][1], cell[1], *cell[0][2:]) not in known
            and cell[1] not in EXACT]
    if todo and runner is None:
        runner = ChunkRunner(engine, ids, prefill)
    for i, (unit, spec) in enumerate(cells):
        raise_if_cancelled(cancel, JOB)
        layer, role = unit[0], unit[1]
        head = unit[2] if len(unit) == 3 else None
        key = cell_key(layer, role, spec, head)
        resumed = key in known
        ref = BOUNDED.get(spec)
        ref_key = cell_key(layer, role, ref[0], head) if ref else None
        if not resumed and spec in EXACT:  # the reference rows themselves: nothing to measure
            known[key] = 0.0
        elif not resumed and ref and ref_key in known and known[ref_key] < ref[1]:
            table.kl.setdefault(unit, {})[spec] = known[ref_key]  # bounded (not persisted: another run may measure)
            table.bounded.append(key)
            emit(on_event, SensitivityMeasured("sensitivity", i + 1, len(cells), f"layer {layer} {role.upper()} {spec}"
                                               " (bounded)", layer=layer, role=role, codec=spec, kl=known[ref_key],
                                               resumed=True, head=-1 if head is None else head))
            continue
        elif not resumed:
            ks, vs = runner.cell(policy, layer, {(role, head): spec})
            kl = runner.kl(ks, vs, start=layer)
            known[key] = kl
            if on_cell is not None:
                on_cell(key, kl)
        table.kl.setdefault(unit, {})[spec] = known[key]
        where = f"layer {layer}" + (f" head {head}" if head is not None else "")
        emit(on_event, SensitivityMeasured("sensitivity", i + 1, len(cells), f"{where} {role.upper()} {spec}",
                                           layer=layer, role=role, codec=spec, kl=known[key], resumed=resumed,
                                           head=-1 if head is None else head))
    return table


def rank_correlation(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation of two equal-length lists (average ranks for ties)."""
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError("rank_correlation needs two lists of the same length, at least 2 long")

    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sx = sum((a - mx) ** 2 for a in rx) ** 0.5
    sy = sum((b - my) ** 2 for b in ry) ** 0.5
    return cov / (sx * sy) if sx and sy else 0.0


def sliding_repricer(engine, runner: ChunkRunner, table: SensitivityTable, base: Policy, codecs: list[str],
                     k_codecs: list[str] | None, granularity: str, known: dict[str, float],
                     on_cell: Callable[[str, float], None] | None = None, cancel: CancelFlag | None = None):
    """``exchange.improve``'s ``reprice`` on a model whose allocation mixes compressed sliding-window layers and
    full-attention layers (else None): ``reprice(policy)`` is ``table`` with the sliding layers' cells re-measured
    at ``policy``'s sliding recent rows (``srecent``; the full-attention layers' cells kept), or None when those
    rows are the base's. Re-measured cells are stored under ``cell_key + "@sr<rows>"`` (``known`` read first, so a
    resumed run measures none again; ``on_cell`` after each new one); ``reprice.measured`` counts the new ones."""
    windows = runner.windows
    sliding = [layer for layer in table.layers if windows[layer] is not None]
    if not sliding or len(sliding) == len(table.layers):
        return None

    def reprice(policy: Policy) -> SensitivityTable | None:
        if policy.sliding_recent == base.sliding_recent:
            return None
        tag = f"@sr{policy.sliding_recent}"
        given = {}
        for unit, row in table.kl.items():
            for codec, kl in row.items():
                key = cell_key(unit[0], unit[1], codec, *unit[2:])
                if windows[unit[0]] is None:
                    given[key] = kl
                elif key + tag in known:
                    given[key] = known[key + tag]

        def stored(key: str, kl: float) -> None:
            reprice.measured += 1
            known[key + tag] = kl
            if on_cell is not None:
                on_cell(key + tag, kl)

        return measure_sensitivity(engine, runner.ids, runner.prefill, codecs, policy, known=given, on_cell=stored,
                                   cancel=cancel, granularity=granularity, k_codecs=k_codecs, runner=runner)

    reprice.measured = 0
    return reprice
