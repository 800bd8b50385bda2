"""``budget=global``: one budget for every evicting layer and KV head (kvpress ``KVzipPress(layerwise=False)``).

kvpress ranks the KVzip scores of every layer and KV head together and drops the lowest ``compression_ratio`` of
all of them, so each layer and head keeps its own count. tqbench keeps the same total as ``budget=layer``: every
(layer, KV head) keeps its sinks and protected tail (``protected_rows``), and of the rows between them the cache
keeps ``sum(share)`` over all of them (``share = kept_rows - sinks - tail``, each layer's own ``keep`` or
``keep@``), the best-scored over all layers and heads together. The raw scores are ranked as kvpress ranks them
(KVzip's are softmax probabilities, comparable across layers; no normalisation, kvpress's default
``kvzip_plus_normalization=False``). Three rules keep the bytes a pure function of the token count
(``estimate.estimate_kv`` counts each layer at its uniform share, exact in total):

- rows move only between (layer, head) pairs whose stores cost the same per row (the same sinks, recent rows and
  K/V codec unit bytes: ``_cost``), each such group keeping the sum of its members' shares;
- every (layer, head) whose share has a row keeps at least one (so its store packs rows, and holds its codec
  state, exactly when a uniform head's would); one whose share has none keeps none;
- sliding-window layers take no part: they hold their window and never evict (``Policy.plan``).

The choice needs every layer's scores before the first layer evicts, so it takes context-pass scores only
(``score=kvzip``: ``keep.CONTEXT_PASS_SCORES``). It is made once per eviction point, when the first evicting layer
reaches it, from every layer's held positions after the call's rows (the layers after it have not appended them
yet: ``Evictor.positions_after``); each layer then keeps its own best-scored rows per head (``Evictor``)."""

from __future__ import annotations

import torch

from tqbench.engine.cache.evict.compact import EvictionError
from tqbench.engine.policy.keep import kept_rows, protected_rows

__all__ = ["GlobalBudget", "global_counts"]


def global_counts(middles: list[torch.Tensor], shares: list[int], groups: list[int]) -> list[int]:
    """How many of its middle rows each entry keeps: ``middles[i]`` the scores of entry ``i``'s rows between its
    sinks and tail (higher: keep), ``shares[i]`` its uniform share, ``groups[i]`` its cost group. Each group keeps
    the sum of its entries' shares, the best-scored of all its entries' rows, every entry with a share at least its
    best row; an entry without a share keeps none."""
    out = [0] * len(middles)
    for g in sorted(set(groups)):
        members = [i for i in range(len(middles)) if groups[i] == g and shares[i] > 0 and middles[i].numel()]
        budget = sum(shares[i] for i in range(len(middles)) if groups[i] == g)
        if not members:
            continue
        parts = []
        for i in members:
            s = middles[i].float().clone()
            s[s.argmax()] = float("inf")  # the floor: every entry with a share keeps its best row
            parts.append(s)
        flat = torch.cat(parts)
        budget = min(budget, flat.numel())
        owner = torch.cat([torch.full((p.numel(),), j) for j, p in enumerate(parts)])
        chosen = owner[flat.topk(budget).indices]
        counts = torch.bincount(chosen, minlength=len(members)).tolist()
        for i, c in zip(members, counts):
            out[i] = int(c)
    return out


def _cost(layer, head: int, dims: tuple[int, int]) -> tuple:
    """What a kept row of ``layer``'s KV head ``head`` costs: rows with equal keys can move between them."""
    pol, plan = layer.policy, layer.plan
    key: tuple = (plan.sink, plan.recent)
    for role, dim in zip(("k", "v"), dims):
        c = pol.head_codec(plan, role, head)
        key += (c.lossless, c.units_bytes(dim, 1), c.tokens_per_unit)
    return key


class GlobalBudget:
    """The cache-wide choice of ``budget=global``: per evicting layer, the rows each KV head keeps at a point."""

    def __init__(self, layers: list, head_dim: int, v_dim: int) -> None:
        self.layers = layers  # the evicting TQLayers (their ``evictor`` is read at each point: reset makes new ones)
        heads = layers[0].kv_heads if layers else 0
        keys: dict[tuple, int] = {}
        #: (layer index, head) -> cost group
        self.group = {(la.plan.layer, h): keys.setdefault(_cost(la, h, (head_dim, v_dim)), len(keys))
                      for la in layers for h in range(heads or 0)}
        self._plan: dict | None = None

    def clear(self) -> None:
        self._plan = None

    def targets(self, evictor, seen: int, t: int) -> list[int]:
        """The rows each KV head of ``evictor``'s layer keeps at the point after ``seen`` tokens (a call of ``t``)."""
        p = self._plan
        if p is None or p["key"] != (seen, t) or evictor.layer_index not in p["left"]:
            p = self._plan = {"key": (seen, t), "targets": self._choose(seen, t),
                              "left": {la.plan.layer for la in self.layers}}
        p["left"].discard(evictor.layer_index)
        return p["targets"][evictor.layer_index]

    def _choose(self, seen: int, t: int) -> dict[int, list[int]]:
        middles, shares, groups, where = [], [], [], []
        for la in self.layers:
            ev = la.evictor
            pos = ev.positions_after(seen, t)  # [B, H, T] (padded)
            if pos.shape[0] != 1:
                raise EvictionError(f"budget=global chooses each sequence's per-layer row counts from its own "
                                    f"scores: a batch of {pos.shape[0]} sequences cannot share them; evict with one "
                                    "sequence per call, or use budget=layer")
            score = ev.rank_positions(pos, seen)[0]
            held = ev.held_counts(pos)
            head, tail = protected_rows(seen, ev.sink, ev.window, ev.recent)
            share = kept_rows(seen, ev.keep, ev.sink, ev.window, ev.recent) - head - tail
            for h, n in enumerate(held):
                middles.append(score[h, head : max(head, n - tail)])
                shares.append(share)
                groups.append(self.group.get((ev.layer_index, h), 0))
                where.append((ev.layer_index, h, head, tail))
        counts = global_counts(middles, shares, groups)
        out: dict[int, list[int]] = {}
        for (layer, _h, head, tail), c in zip(where, counts):
            out.setdefault(layer, []).append(head + c + tail)
        return out
