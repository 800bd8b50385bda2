"""Per-KV-head groups in the ``fused`` mode: a layer whose K and V are per-head lists (``HeadSplitCodec``, one
grouping of heads for both). On the native kernel the whole layer is one call (each group one side naming its heads,
``native_glue.store_sides``); elsewhere (Triton, the torch reference, or when the one call cannot run) it is
attended group by group, each group through the ordinary fused path.

``group_views(kv)`` gives, per group, a ``FusedKV`` over that group's heads only: its K and V stores seen
through ``GroupStore`` (the group's sub-codec, its state, its packed fields, the store's counts), the dense rows
sliced to its heads (a view when its heads are consecutive), its packed fields as stored (each group's own
tensors: nothing copied) and, with the query heads those KV heads serve (GQA), the rows of the call. A dense
group (an ``fp16`` head in a list) hands its rows as full-precision rows. The caller runs each group on the
native kernel, Triton or the torch reference as it would a whole layer, and writes each group's output into
its query heads: a loop over a layer's few groups, never over heads.
"""

from __future__ import annotations

import weakref
from dataclasses import replace

import torch

from tqbench.engine.cache.handles import FusedKV
from tqbench.engine.codecs.heads import HeadSplitCodec

__all__ = ["GroupStore", "group_label", "group_label_of", "group_labels", "group_stores", "group_views", "is_per_head",
           "query_index"]


class GroupStore:
    """What the fused glue reads from a store, for one group of heads of a per-head store."""

    def __init__(self, store, g: int) -> None:
        self.store = store
        self.g = g
        self.codec = store.codec.subs[g]
        self.heads = store.codec.groups[g]

    @property
    def state(self) -> dict | None:
        st = self.store.state
        return None if st is None else HeadSplitCodec.sub_fields(st, self.g)

    @property
    def state_version(self) -> int:
        return self.store.state_version

    @property
    def n_packed(self) -> int:
        return 0 if self.codec.lossless else self.store.n_packed

    @property
    def n_full_precision(self) -> int:
        return self.store.n_full_precision + (self.store.n_packed if self.codec.lossless else 0)

    @property
    def packed(self) -> dict:
        return HeadSplitCodec.sub_fields(self.store.packed, self.g)


# store -> its GroupStores (kept, so the kernels' per-store description cache keys on a lasting object)
_VIEWS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def group_stores(store) -> list[GroupStore]:
    """The ``GroupStore`` of every group of a per-head store (kept while its codec stands)."""
    views = _VIEWS.get(store)
    if views is None or views[0].codec is not store.codec.subs[0]:
        views = [GroupStore(store, g) for g in range(len(store.codec.groups))]
        _VIEWS[store] = views
    return views


def is_per_head(kv) -> bool:
    return isinstance(getattr(kv.k_store, "codec", None), HeadSplitCodec)


def _parts(parts: tuple, codec: HeadSplitCodec, g: int) -> tuple:
    out = []
    for kind, n, payload in parts:
        if kind == "dense":
            out.append(("dense", n, codec.take(payload, g)))
        else:
            sub = HeadSplitCodec.sub_fields(payload, g)
            out.append(("dense", n, sub["x"]) if codec.subs[g].lossless else ("packed", n, sub))
    return tuple(out)


def group_views(kv: FusedKV) -> list[FusedKV]:
    """One ``FusedKV`` per group of heads of a per-head layer's handle, in group order."""
    kc, vc = kv.k_store.codec, kv.v_store.codec
    if kc.groups != vc.groups:
        raise RuntimeError(f"per-head K ({kc.spec}) and V ({vc.spec}) were built over different groups of heads")
    ks, vs = group_stores(kv.k_store), group_stores(kv.v_store)
    out = []
    for g in range(len(kc.groups)):
        out.append(replace(
            kv, k_store=ks[g], v_store=vs[g], new_k=kc.take(kv.new_k, g), new_v=vc.take(kv.new_v, g),
            k_parts=_parts(kv.k_parts, kc, g), v_parts=_parts(kv.v_parts, vc, g),
            extra_k=None if kv.extra_k is None else kc.take(kv.extra_k, g),
            extra_v=None if kv.extra_v is None else vc.take(kv.extra_v, g)))
    return out


def query_index(heads: tuple[int, ...], n_rep: int, device) -> slice | torch.Tensor:
    """The query heads the KV heads ``heads`` serve (GQA: KV head ``h`` serves query heads ``h*n_rep ..``)."""
    if heads == tuple(range(heads[0], heads[0] + len(heads))):
        return slice(heads[0] * n_rep, (heads[0] + len(heads)) * n_rep)
    return torch.tensor([h * n_rep + r for h in heads for r in range(n_rep)], device=device)


def take_heads(x: torch.Tensor, index, dim: int = 1) -> torch.Tensor:
    if isinstance(index, slice):
        return x[(slice(None),) * dim + (index,)]
    return x.index_select(dim, index)


def put_heads(out: torch.Tensor, index, rows: torch.Tensor) -> None:
    if isinstance(index, slice):
        out[:, index] = rows
    else:
        out.index_copy_(1, index, rows)


def _label(k_spec: str, v_spec: str, heads) -> str:
    return f"k={k_spec} v={v_spec} heads {','.join(str(h) for h in heads)}"


def group_label(kv_g: FusedKV) -> str:
    """How the report names a group: its codecs and its heads (``k=turbo4 v=turbo2 heads 0,2``)."""
    return _label(kv_g.k_store.codec.spec, kv_g.v_store.codec.spec, kv_g.k_store.heads)


def group_label_of(kc: HeadSplitCodec, vc: HeadSplitCodec, g: int) -> str:
    """``group_label`` of group ``g`` of a per-head layer's K and V codecs (without building its view)."""
    return _label(kc.subs[g].spec, vc.subs[g].spec, kc.groups[g])


# K codec -> (V codec, the labels of its groups): a layer's labels, made once per codec pair
_LABELS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def group_labels(kv: FusedKV) -> list[str]:
    """``group_label`` of every group of a per-head layer's handle, in group order (without building the views)."""
    kc, vc = kv.k_store.codec, kv.v_store.codec
    hit = _LABELS.get(kc)
    if hit is None or hit[0] is not vc:
        hit = (vc, [group_label_of(kc, vc, g) for g in range(len(kc.groups))])
        _LABELS[kc] = hit
    return hit[1]
