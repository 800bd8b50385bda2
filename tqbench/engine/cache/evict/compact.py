"""``compact_store``: keep given rows of a ``KVStore``, per KV head, in place.

A store holds ``[sink rows][packed rows][tail rows]`` with the same count for every KV head. After an eviction
each head keeps its own rows (sorted by position), and the store is rebuilt with the layout its policy gives
the kept count: every head's first kept rows past the sinks fill the packed section (codes of rows that were
packed are gathered as they are; rows that were exact in the tail are encoded now, from their exact values,
as the next flush would have encoded them), the rest stay exact in the tail. Nothing is re-quantized. The
store then packs by its ordinary rule, so its bytes are a pure function of the kept count
(``estimate.store_parts``).
"""

from __future__ import annotations

import torch

from tqbench.engine.cache.buffer import GrowBuffer


class EvictionError(ValueError):
    """An eviction the store cannot do exactly (said why)."""


def _take(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Rows ``idx`` [B, H, n] of ``t`` [B, H, T, ...] along dim 2, per (batch, head)."""
    shape = (*idx.shape, *t.shape[3:])
    ix = idx.reshape(*idx.shape, *([1] * (t.dim() - 3))).expand(shape)
    return torch.gather(t, 2, ix.to(t.device))


def _set(buf: GrowBuffer, x: torch.Tensor) -> None:
    buf.data, buf.n, buf.start = None, 0, 0
    buf.append(x.contiguous())


def compact_store(store, idx: torch.Tensor) -> int:
    """Keep rows ``idx`` [B, H, n] (sorted ordinals into the rows the store holds; every sink row kept) of
    ``store``; returns the rows each head dropped. Raises ``EvictionError`` when packed rows would have to be
    cut from a codec that packs several tokens per unit or keeps its codes in another layout."""
    hn, npk, tn = store.head.n, store.n_packed, store.tail.n
    total, n = hn + npk + tn, idx.shape[2]
    if n == total:
        return 0
    if hn and not bool((idx[..., :hn] == torch.arange(hn, device=idx.device)).all()):
        raise EvictionError("an eviction must keep every sink row")
    rest = idx[..., hn:] - hn
    packed_kept = (rest < npk).sum(-1)
    q = int(packed_kept.max()) if npk else 0
    tail = store.tail.view()
    if npk and not (q == npk and bool((rest[..., :npk] == torch.arange(npk, device=idx.device)).all())):
        _cut_packed(store, rest, q, tail)
    tail_idx = rest[..., q:] - npk
    if tail_idx.shape[2]:
        _set(store.tail, _take(tail, tail_idx))
    else:
        store.tail.drop_front(store.tail.n)
    store.evicted += total - n
    return total - n


def _heads_of(codec, name: str, idx: torch.Tensor) -> torch.Tensor:
    """``idx`` [B, H, ...] limited to the KV heads whose packed field ``name`` is: a per-head codec list keeps
    each group's fields (``g{g}.``-prefixed) over that group's heads only; any other field covers every head."""
    groups = getattr(codec, "groups", None)
    if groups is None or not name.startswith("g"):
        return idx
    g = name[1:].split(".", 1)[0]
    if not g.isdigit() or not name.startswith(codec.field_prefix(int(g))):
        return idx
    return codec.take(idx, int(g))


def _cut_packed(store, rest: torch.Tensor, q: int, tail: torch.Tensor | None) -> None:
    codec, npk = store.codec, store.n_packed
    if codec.tokens_per_unit != 1:
        raise EvictionError(
            f"the {codec.spec} codec packs {codec.tokens_per_unit} tokens per unit: an eviction cannot cut rows "
            "already packed; evict only at prefill, in one call (no re-eviction while decoding, no prefill in "
            "chunks), or use a per-row codec such as turbo4")
    packed = store.packed_view()
    for name, t in packed.items():
        if t.dim() < 3 or t.shape[2] != npk:
            raise EvictionError(f"the {codec.spec} codec keeps its packed {name!r} codes in a layout an eviction "
                                "cannot cut per row")
    if q == 0:
        store.packed, store.n_packed = {}, 0
        return
    first = rest[..., :q]
    from_packed = first < npk
    gathered = {name: _take(t, _heads_of(codec, name, first.clamp(max=npk - 1))) for name, t in packed.items()}
    if not bool(from_packed.all()):
        rows = _take(tail, (first - npk).clamp(min=0))
        fresh = codec.encode(rows, store.state)
        for name, t in gathered.items():
            fp = _heads_of(codec, name, from_packed)
            mask = fp.reshape(*fp.shape, *([1] * (t.dim() - 3))).to(t.device)
            gathered[name] = torch.where(mask, t, fresh[name])
    for name, t in gathered.items():
        _set(store.packed.setdefault(name, GrowBuffer()), t)
    store.n_packed = q
