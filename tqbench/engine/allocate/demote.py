"""The demote tier on the tokens axis: a layer's evicted rows dropped, or kept at a cheaper codec (``demote@``).

- ``parse_demote_codecs``: the codecs offered for the evicted rows (none: the tokens axis only drops them).
- ``DemoteTier``: the evicted rows of a layer as the cache's demote store holds them (``Evictor``: the rows a
  ``KeepCells.index`` does not keep, gathered per KV head in order, appended to one ``KVStore`` at the demote
  codec with no sinks and no recent rows, dequantized), put back at their positions in the prefill's rows so the
  chunk attends them (no mask: the same softmax as the cache's tier read beside the held rows). ``cell``: the
  chunk KL with one layer evicting to a keep and demoting (its kept rows exact), the counterpart of
  ``KeepCells.cell``; ``apply``: a joint measurement's layers that demote.
- ``tier_options``: a layer's starting points in the joint solve (``joint.solve_joint``): for a keep below 1, the
  dropped option and one per demote codec, each with its measured KL and the tier's exact bytes at the stated
  context (``estimate_kv``'s per-layer bytes with the tier less without; the tier's shared objects are reserved
  as the codecs' are). A demote choice rides in the solve's configuration as the unit ``(layer, DEMOTE)``;
  ``split_choice`` takes it out again.
- ``with_demotes``: a policy with ``demote@LAYERS=codec`` (or ``=none``) for the layers that differ from its base.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from tqbench.engine.allocate.keeps import keep_key, with_keeps
from tqbench.engine.cache.estimate import estimate_kv
from tqbench.engine.cache.evict.compact import _take
from tqbench.engine.cache.store import KVStore
from tqbench.engine.codecs import nominal_bits
from tqbench.engine.policy.checks import check_demote_cheaper
from tqbench.engine.policy.spec import NO_DEMOTE, Policy
from tqbench.engine.request import RequestError

#: the pseudo-role of a layer's demote choice inside the joint solve's configurations
DEMOTE = "demote"


def check_demote_codecs(value, axes: tuple[str, ...], keep_granularity: str = "layer",
                        kept: tuple[list[str], list[str]] | None = None) -> tuple[str, ...]:
    """``parse_demote_codecs`` plus where a tier can be searched: with the tokens axis, per layer; the one rule the
    engine and every front end apply (before a model loads). ``kept``: the (K, V) codecs the search may keep rows
    at; every tier must be cheaper than the cheapest of them (the policy's rule, ``check_demote_cheaper``), so no
    cell is measured for a tier the allocated policy would refuse."""
    demotes = parse_demote_codecs(value)
    if demotes and "tokens" not in axes:
        raise RequestError("demote_codecs", ",".join(demotes), "the demote tier keeps a layer's evicted rows: "
                           "search the tokens axis too (bits,tokens or tokens), or give none")
    if demotes and keep_granularity == "head":
        raise RequestError("demote_codecs", ",".join(demotes), "the demote tier is searched per layer: with per-head "
                           "keeps (keep granularity head) give none")
    if demotes and kept is not None:
        k, v = (min(specs, key=nominal_bits) for specs in kept)
        for c in demotes:
            try:
                check_demote_cheaper(k, v, c)
            except ValueError as exc:
                raise RequestError("demote_codecs", ",".join(demotes), f"{exc}; the search keeps rows at "
                                   f"{', '.join(dict.fromkeys([*kept[0], *kept[1]]))}") from None
    return demotes


def parse_demote_codecs(value) -> tuple[str, ...]:
    """Codecs offered for a layer's evicted rows (``"turbo2,turbo1"`` or a list; ``none`` or empty: none), each
    checked by the policy's own rule for ``demote=``; ``RequestError`` (field ``demote_codecs``)."""
    items = value.split(",") if isinstance(value, str) else list(value or ())
    items = [str(c).strip() for c in items if str(c).strip()]
    if [c.lower() for c in items] == [NO_DEMOTE]:
        return ()
    out = []
    for c in items:
        if c.lower() == NO_DEMOTE:
            raise RequestError("demote_codecs", value, "none means no demote tier: give it alone, or codecs only")
        try:
            Policy(keep=0.5, demote=c)
        except ValueError as exc:
            raise RequestError("demote_codecs", value, f"{exc}; give codecs such as turbo2,turbo1 or none") from None
        if c not in out:
            out.append(c)
    return tuple(out)


def demote_key(layer: int, score: str, window: int, keep: float, codec: str, chunk: int = 1) -> str:
    """A demote cell's key in the partial results file: the keep cell's (``keeps.keep_key``) then
    ``.demote-<codec>``."""
    return f"{keep_key(layer, score, window, keep, chunk)}.demote-{codec}"


def layer_demotes(policy: Policy, geometry) -> dict[int, str]:
    """Layer -> demote codec for the layers of ``policy`` that evict and keep their evicted rows."""
    plans = policy.plan(geometry.num_layers, list(geometry.layer_types) if geometry.layer_types else None)
    return {p.layer: p.demote for p in plans if p.evicts and p.demote}


def with_demotes(base: Policy, demotes: dict[int, str]) -> Policy:
    """``base`` with ``demote@layers=codec`` (``none``: dropped) for every layer whose demote differs from
    ``base.demote`` (earlier demote overrides replaced; the others kept)."""
    groups: dict[str, list[int]] = {}
    for layer, codec in sorted(demotes.items()):
        if codec != base.demote:
            groups.setdefault(codec or NO_DEMOTE, []).append(layer)
    rest = tuple(o for o in base.overrides if o[0] != DEMOTE)
    return replace(base, overrides=rest + tuple((DEMOTE, "+".join(map(str, ls)), c) for c, ls in sorted(groups.items())))


def split_choice(choice: dict) -> tuple[dict, dict[int, str]]:
    """A joint solve's configuration -> (codec units, layer -> demote codec)."""
    units = {u: s for u, s in choice.items() if u[1] != DEMOTE}
    return units, {u[0]: s for u, s in choice.items() if u[1] == DEMOTE}


class DemoteTier:
    """The demote tier of a ``KeepCells``' calibration prefill (dequantized rows kept between calls)."""

    def __init__(self, cells) -> None:
        self.cells = cells
        self._rows: dict[tuple, torch.Tensor] = {}

    def rows(self, policy: Policy, role: str, layer: int, keep, codec: str, base: torch.Tensor) -> torch.Tensor:
        """``base`` (the layer's ``role`` rows [B, H, P, D] as the candidate holds its kept ones) with the rows
        ``keep`` evicts replaced by the demote store's dequantized rows."""
        idx = self.cells.index(layer, keep, policy.sink, policy.recent)
        key = (role, layer, keep, codec, policy.sink, policy.recent, tuple(policy.codec_options(role).items()))
        if key not in self._rows:
            src = (self.cells.runner.keys if role == "k" else self.cells.runner.values)[layer]
            b, h, p = idx.shape[0], idx.shape[1], src.shape[2]
            gone = torch.ones(b, h, p, dtype=torch.bool, device=idx.device)
            gone.scatter_(2, idx, False)
            gone_idx = gone.nonzero()[:, 2].view(b, h, p - idx.shape[2])
            store = KVStore(policy.build_codec(codec, role, layer=layer), 0, 0)
            with torch.inference_mode():
                store.append(_take(src, gone_idx))
                self._rows[key] = (gone_idx, store.dense(src.dtype))
        gone_idx, q = self._rows[key]
        out = base.clone()
        out.scatter_(2, gone_idx.view(*gone_idx.shape, 1).expand_as(q).to(out.device), q.to(out.dtype))
        return out

    def cell(self, policy: Policy, layer: int, keep, codec: str) -> float:
        """The chunk KL of ``layer`` alone evicting to ``keep`` with its evicted rows at ``codec`` (kept rows
        exact; every row attended)."""
        r = self.cells.runner
        ks, vs = list(r.keys), list(r.values)
        ks[layer] = self.rows(policy, "k", layer, keep, codec, ks[layer])
        vs[layer] = self.rows(policy, "v", layer, keep, codec, vs[layer])
        return r.kl(ks, vs, start=layer)

    def apply(self, policy: Policy, keeps: dict[int, float], demotes: dict[int, str], ks: list, vs: list,
              masks: dict) -> None:
        """A joint measurement: the demoting layers' evicted rows put back at their codec (in ``ks``/``vs``) and
        their masks dropped (attention reads them)."""
        for layer, codec in demotes.items():
            ks[layer] = self.rows(policy, "k", layer, keeps[layer], codec, ks[layer])
            vs[layer] = self.rows(policy, "v", layer, keeps[layer], codec, vs[layer])
            masks.pop(layer, None)


def tier_bytes(base: Policy, geometry, context: int, keep, codec: str) -> list[int]:
    """Per layer, the bytes of the demote tier at ``codec`` when every layer keeps ``keep`` at ``context`` tokens
    (exact: ``estimate_kv``'s layer bytes with the tier less without; shared objects apart)."""
    dropped = with_keeps(replace(base, demote="", overrides=tuple(o for o in base.overrides if o[0] != DEMOTE)),
                         dict.fromkeys(range(geometry.num_layers), keep))
    a = estimate_kv(replace(dropped, demote=codec), geometry, context).layer_bytes
    b = estimate_kv(dropped, geometry, context).layer_bytes
    return [x - y for x, y in zip(a, b)]


def tier_options(keep_kl: dict, demote_kl: dict, codecs: tuple[str, ...], geometry, context: int):
    """``options(layer, keep, quantum, base)``: the starting points of ``layer`` at ``keep`` in the joint solve
    under ``base`` (its protection): [(cost in quanta, KL, configuration)], dropped first, then one per codec."""
    cache: dict[tuple, list[int]] = {}

    def options(layer: int, keep, quantum: int, base: Policy) -> list[tuple[int, float, tuple]]:
        out = [(0, keep_kl.get((layer, keep), 0.0), ())]
        if keep >= 1:
            return out
        for codec in codecs:
            key = (keep, codec, base.to_string())
            if key not in cache:
                cache[key] = tier_bytes(base, geometry, context, keep, codec)
            out.append((-(-cache[key][layer] // quantum), demote_kl[(layer, keep, codec)],
                        (((layer, DEMOTE), codec),)))
        return out

    return options


def shared_specs(codecs: tuple[str, ...]) -> set[tuple[str, str]]:
    """(role, codec) pairs whose shared objects (rotations, codebooks) the solve reserves for the tier."""
    return {(role, c) for c in codecs for role in ("k", "v")}
