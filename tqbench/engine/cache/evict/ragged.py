"""Ragged rows per KV head (``heads=ada``, or a per-head keep list ``keep=0.5|1|0.25``): each KV head of a layer
holds its own number of rows, none padded.

- ``RaggedStore``: a layer's K (or V) rows as one ``KVStore`` per KV head (each ``[B, 1, rows_h, ...]``: its
  own sinks, packed rows and exact tail, at its own head's codec: ``Policy.head_codec``, so a per-head codec
  list or a calibrated key codec gives each head's store that head's codec or table), behind what the layer and
  the evictor read from a store. Bytes are the heads' stores' bytes, so a head's rows cost exactly what they
  would alone. A demote tier (``policy.demote``) of a ragged layer is a ``RaggedStore`` too, each head's evicted
  rows in its own store.
- ``HeadRows``: per-head ``[B, 1, rows_h]`` bookkeeping (the held rows' positions, h2o's mass).
- ``select_ada``: AdaKV's choice of rows (Feng et al. 2024, kvpress ``AdaKVPress``): the scores of all the heads
  of a layer ranked together, the layer keeping ``heads * target`` rows, each head at least its floor.

Padding exists only transiently, in compute: ``padded`` gives ``[B, H, max rows, ...]`` with each head's rows
first (what attention and the scores read), and the attention function masks each head's padding
(``EvictKV.lengths``).
"""

from __future__ import annotations

import torch

from tqbench.engine.cache.buffer import GrowBuffer
from tqbench.engine.cache.evict.compact import EvictionError, _set, compact_store
from tqbench.engine.cache.evict.scores import PAD
from tqbench.engine.cache.store import KVStore
from tqbench.engine.policy.keep import ada_floor_rows

__all__ = ["RAGGED", "HeadRows", "RaggedStore", "check_ragged_codec", "pad_rows", "select_ada"]

#: how messages name a layer whose KV heads hold different row counts
RAGGED = "a ragged layer (heads=ada, or a per-head keep list)"

#: a padded row's position: after every query, so a score that masks keys after a query masks it
PAD_POSITION = PAD


def check_ragged_codec(codec, role: str) -> None:
    """A ragged layer's per-head codec packs each row on its own (a head's rows cost a whole number of rows)."""
    if codec.tokens_per_unit != 1:
        raise EvictionError(f"{RAGGED} needs a codec that packs each row on its own: {codec.spec} ({role}) packs "
                            f"{codec.tokens_per_unit} tokens per unit, so a head's rows would not fill whole units; "
                            "use a per-row codec such as turbo4, or one keep value for every head with "
                            "heads=uniform")


def pad_rows(parts: list[torch.Tensor | None], fill=0) -> torch.Tensor | None:
    """``[B, 1, n_h, ...]`` per head -> ``[B, H, max n_h, ...]``, each head's rows first, ``fill`` after them."""
    ref = next((p for p in parts if p is not None), None)
    if ref is None:
        return None
    span = max(0 if p is None else p.shape[2] for p in parts)
    out = ref.new_full((ref.shape[0], len(parts), span, *ref.shape[3:]), fill)
    for h, p in enumerate(parts):
        if p is not None and p.shape[2]:
            out[:, h : h + 1, : p.shape[2]] = p
    return out


class RaggedStore:
    """The K or the V rows of one layer, one ``KVStore`` per KV head."""

    ragged = True

    def __init__(self, codec, sink: int, recent: int, head_codec=None, role: str = "k") -> None:
        self.codec = codec  # the layer's codec (a per-head list: its ``HeadSplitCodec``); each store has its head's
        #: ``head_codec(h)``: the codec of KV head ``h``'s store (``Policy.head_codec``; default: ``codec``)
        self.head_codec = head_codec or (lambda h: codec)
        self.role = role
        self.sink, self.recent = sink, recent
        self.stores: list[KVStore] = []  # one per KV head, made on the first rows (their head count)
        self.window = None
        self.dropped = 0
        self._defer = False

    # -- sizes ------------------------------------------------------------------------------------
    @property
    def rows(self) -> list[int]:
        """Rows each KV head holds."""
        return [s.n_tokens for s in self.stores]

    @property
    def n_tokens(self) -> int:
        """The most rows a head holds (the span attention reads, each head's padding masked)."""
        return max(self.rows, default=0)

    @property
    def n_packed(self) -> int:
        """Packed rows over all heads."""
        return sum(s.n_packed for s in self.stores)

    @property
    def seen(self) -> int:
        return self.stores[0].seen if self.stores else 0

    @property
    def evicted(self) -> int:
        """Rows dropped over all heads."""
        return sum(s.evicted for s in self.stores)

    @property
    def tail_start(self) -> int:
        return min((s.tail_start for s in self.stores), default=0)

    @property
    def peak_dense_bytes(self) -> int:
        return sum(s.peak_dense_bytes for s in self.stores)

    @property
    def defer(self) -> bool:
        return self._defer

    @defer.setter
    def defer(self, value: bool) -> None:
        self._defer = value
        for s in self.stores:
            s.defer = value

    # -- writes ---------------------------------------------------------------------------------------
    def append_points(self, x: torch.Tensor, points: list[int] | None = None) -> tuple[list, list[int]]:
        """Every head's rows of this call to its store; returns (each head's packed chunks, [tail_start])."""
        if points is not None and len(points) > 1:
            raise EvictionError(f"{RAGGED} keeps one store per KV head and packs once per call: a call with "
                                "several store points (speculative verification) is not supported")
        self._make(x.shape[1])
        chunks = [s.append(x[:, h : h + 1]) for h, s in enumerate(self.stores)]
        return chunks, [self.tail_start]

    def _make(self, heads: int) -> None:
        if self.stores:
            return
        codecs = [self.head_codec(h) for h in range(heads)]
        for c in codecs:
            check_ragged_codec(c, self.role)
        self.stores = [KVStore(c, self.sink, self.recent) for c in codecs]
        self.defer = self._defer

    def append_heads(self, rows: list[torch.Tensor]) -> None:
        """Head ``h``'s rows ``rows[h]`` ``[B, 1, n_h, D]`` to its store (a demote tier: each head its own count)."""
        self._make(len(rows))
        for s, x in zip(self.stores, rows):
            if x.shape[2]:
                s.append(x)

    def shared_items(self, head_dim: int) -> dict[str, int]:
        """The shared objects (rotations, codebooks) of the heads' stores that packed rows, by name."""
        out: dict[str, int] = {}
        for s in self.stores:
            if s.n_packed:
                out.update(s.codec.shared_items(head_dim))
        return out

    def release(self) -> None:
        self._defer = False
        for s in self.stores:
            s.release()

    def mark(self) -> None:
        raise EvictionError(f"{RAGGED} cannot be cropped or verified speculatively: decode without speculation")

    def unmark(self) -> None:
        for s in self.stores:
            s.unmark()

    def compact(self, idx: list[torch.Tensor]) -> int:
        """Keep rows ``idx[h]`` ``[B, 1, n_h]`` of each head; returns the rows dropped over all heads."""
        return sum(compact_store(s, i) for s, i in zip(self.stores, idx))

    # -- reads ----------------------------------------------------------------------------------------
    def head_dense(self, dtype) -> list[torch.Tensor | None]:
        return [s.dense(dtype) for s in self.stores]

    def dense(self, dtype) -> torch.Tensor | None:
        """``[B, H, n_tokens, D]``: each head's rows first, zeros after them (masked where read)."""
        return pad_rows(self.head_dense(dtype))

    def bytes_breakdown(self) -> dict[str, int]:
        out = {"full_precision": 0, "packed": 0, "state": 0}
        for s in self.stores:
            for k, v in s.bytes_breakdown().items():
                out[k] += v
        return out

    # -- batch ------------------------------------------------------------------------------------------
    def select_batch(self, index: torch.Tensor) -> None:
        for s in self.stores:
            s.select_batch(index)

    def repeat_batch(self, repeats: int) -> None:
        for s in self.stores:
            s.repeat_batch(repeats)


class HeadRows:
    """Per-head rows of bookkeeping (``[B, 1, n_h]`` each): what ``GrowBuffer`` is to a uniform layer."""

    def __init__(self, heads: int) -> None:
        self.bufs = [GrowBuffer() for _ in range(heads)]

    @property
    def data(self):
        return self.bufs[0].data

    def append(self, x: torch.Tensor) -> None:
        for h, b in enumerate(self.bufs):
            b.append(x[:, h : h + 1])

    def heads(self) -> list[torch.Tensor]:
        return [b.view() for b in self.bufs]

    def view(self, fill=0) -> torch.Tensor:
        """``[B, H, max n_h]``, each head's rows first, ``fill`` after."""
        return pad_rows(self.heads(), fill)

    def take(self, idx: list[torch.Tensor]) -> None:
        for b, i in zip(self.bufs, idx):
            _set(b, torch.gather(b.view(), 2, i.to(b.data.device)))

    def add_(self, x: torch.Tensor) -> None:
        """Add ``x`` ``[B, H, >= n_h]`` (padded) to each head's rows."""
        for h, b in enumerate(self.bufs):
            v = b.view()
            v.add_(x[:, h : h + 1, : v.shape[2]])

    def nbytes(self) -> int:
        return sum(b.view().numel() * b.view().element_size() for b in self.bufs if b.data is not None)

    def map(self, fn) -> None:
        for b in self.bufs:
            if b.data is not None:
                b.data = fn(b.data)


def cost_groups(k_store, v_store, k_dim: int, v_dim: int) -> list[tuple[int, ...]]:
    """A ragged layer's KV heads grouped by what a packed row costs them (K and V unit bytes of each head's own
    codec): rows can move between the heads of a group without changing the layer's bytes."""
    groups: dict[tuple, list[int]] = {}
    for h, (ks, vs) in enumerate(zip(k_store.stores, v_store.stores)):
        key = (ks.codec.units_bytes(k_dim, 1), ks.codec.tokens_per_unit, vs.codec.units_bytes(v_dim, 1),
               vs.codec.tokens_per_unit)
        groups.setdefault(key, []).append(h)
    return [tuple(g) for g in groups.values()]


def select_ada(score: torch.Tensor, held: list[int], target: int, head: int, tail: int,
               floor_frac: float, drop_one: bool = False, groups: list | None = None) -> list[torch.Tensor]:
    """AdaKV: the sorted ordinals ``[B, 1, n_h]`` each KV head keeps of its ``held[h]`` rows (``score``
    ``[B, H, max held]``, higher: keep; padding ignored). Every head keeps its first ``head`` and last ``tail``
    rows; of the rows between them the layer keeps ``H * (target - head - tail)``, every head at least
    ``ada_floor_rows`` (or all it has), the rest the best-scored over all heads together. One sequence
    (``B == 1``): the heads' counts are that sequence's. ``drop_one`` (a demote tier): every head that has
    middle rows drops at least its worst-scored one (so every head's demote store holds rows, and its codec
    state, whenever the layer demotes: ``estimate`` counts them so; the budget always leaves a row per head,
    since the heads hold a multiple of ``H`` rows and more than ``H * target`` when this runs). ``groups``: the
    heads whose rows cost the same (``cost_groups``; a per-head codec list): rows are shared within each group
    only, each group keeping ``len(group) * target`` (so the layer's bytes do not depend on the split)."""
    if groups is not None and len(groups) > 1:
        out: list = [None] * len(held)
        for g in groups:
            sub = select_ada(score[:, list(g)], [held[h] for h in g], target, head, tail, floor_frac, drop_one)
            for h, i in zip(g, sub):
                out[h] = i
        return out
    b, h, span = score.shape
    if b != 1:
        raise EvictionError(f"heads=ada chooses each sequence's per-head row counts from its own scores: a batch of "
                            f"{b} sequences cannot share them; evict with one sequence per call (tqbench's batched "
                            "serving prefills each request alone), or use heads=uniform")
    dev = score.device
    col = torch.arange(span, device=dev)
    held_t = torch.tensor(held, device=dev).view(h, 1)
    middle = (col >= head) & (col < held_t - tail)  # [H, span]
    if drop_one:
        worst = score[0].float().masked_fill(~middle, float("inf")).argmin(-1, keepdim=True)  # [H, 1]
        middle = middle & ~((col == worst) & middle.any(-1, keepdim=True))
    s = score[0].float().masked_fill(~middle, float("-inf"))
    share = target - head - tail
    floor = ada_floor_rows(target, head, tail, floor_frac)
    n_mid = middle.sum(-1)
    if floor:  # each head's floor (or every middle row it has): ranked first
        k = min(floor, span)
        top = s.topk(k, dim=-1).indices  # [H, k]
        take = torch.arange(k, device=dev).view(1, k) < n_mid.clamp(max=floor).view(h, 1)
        s = s.scatter(1, top, torch.where(take, s.new_full(top.shape, float("inf")), s.gather(1, top)))
    budget = h * share
    if int(n_mid.sum()) < budget:
        raise EvictionError(f"heads=ada: the heads hold {int(n_mid.sum())} evictable rows, fewer than the layer's "
                            f"budget of {budget} (a bug: the store and the budget disagree)")
    chosen = torch.zeros(h * span, dtype=torch.bool, device=dev)
    chosen[s.reshape(-1).topk(budget).indices] = True
    chosen = chosen.view(h, span) | (col < head) | ((col >= held_t - tail) & (col < held_t))
    return [chosen[i].nonzero().view(1, 1, -1) for i in range(h)]
