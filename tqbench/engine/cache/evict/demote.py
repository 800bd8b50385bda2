"""``DemoteTier`` (``demote=turbo2``, ``demote@L=``): the rows a layer's budget evicts, kept at a cheaper codec
instead of dropped; attention reads them before the held rows. It wraps any score and any head budget
(``budgets``): it takes whatever rows the budget drops, from the rows as attention read them. A ragged layer's
tier keeps each KV head's evicted rows in its own store (its codec state its own)."""

from __future__ import annotations

import torch

from tqbench.engine.cache.evict.compact import _take
from tqbench.engine.cache.evict.ragged import RaggedStore
from tqbench.engine.cache.store import KVStore

__all__ = ["DemoteTier", "gone_rows"]


def gone_rows(idx: torch.Tensor, held: int) -> torch.Tensor:
    """The sorted ordinals ``[B, H, held - n]`` of the rows ``idx`` ``[B, H, n]`` (sorted) does not keep."""
    b, h = idx.shape[:2]
    gone = torch.ones(b, h, held, dtype=torch.bool, device=idx.device)
    gone.scatter_(2, idx, False)
    return gone.nonzero()[:, 2].view(b, h, held - idx.shape[2])


class DemoteTier:
    def __init__(self, plan, policy, ragged: bool) -> None:
        self.ragged = ragged
        if ragged:
            self.stores = tuple(RaggedStore(
                policy.build_codec(plan.demote, role, layer=plan.layer), 0, 0, role=role,
                head_codec=lambda h, role=role: policy.build_codec(plan.demote, role, layer=plan.layer, heads=(h,)))
                for role in ("k", "v"))
        else:
            self.stores = tuple(KVStore(policy.build_codec(plan.demote, role, layer=plan.layer), 0, 0)
                                for role in ("k", "v"))

    def take(self, keys: torch.Tensor, values: torch.Tensor, idx, held) -> None:
        """The rows ``idx`` does not keep (``[B, H, n]`` of ``held``; ragged: one ``[B, 1, n_h]`` per head of its
        ``held[h]``) of ``keys`` and ``values`` (dense, as attention read them) to the tier."""
        for store, rows in zip(self.stores, (keys, values)):
            if self.ragged:
                store.append_heads([_take(rows[:, h : h + 1, :n], gone_rows(i, n).to(rows.device))
                                    for h, (i, n) in enumerate(zip(idx, held))])
            else:
                store.append(_take(rows, gone_rows(idx, held).to(rows.device)))

    def head_rows(self) -> list[int]:
        """Demoted rows per KV head (a uniform layer: one entry, every head's count)."""
        return self.stores[0].rows if self.ragged else [self.stores[0].n_tokens]

    @property
    def rows(self) -> int:
        """Demoted rows per KV head (a ragged layer: the mean over its heads)."""
        rows = self.head_rows()
        return sum(rows) // len(rows) if rows else 0

    def dense(self, role: str, dtype) -> torch.Tensor | None:
        """The demoted rows of K (``role`` "k") or V, dequantized (a ragged layer: padded, as ``RaggedStore``)."""
        return self.stores[0 if role == "k" else 1].dense(dtype)

    def heads(self, role: str, dtype, heads: int) -> list:
        """A ragged layer's demoted rows per KV head (``[B, 1, n_h, D]`` or None), dequantized."""
        store = self.stores[0 if role == "k" else 1]
        if not store.stores:
            return [None] * heads
        return [s.dense(dtype) for s in store.stores]
