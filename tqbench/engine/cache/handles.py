"""What a compressed layer hands the attention function instead of plain K/V tensors.

- ``FusedKV`` (fused mode): the packed stores themselves, the parts they held before this call, this call's
  rows, (in a speculative verification call) the column sets of ``precision.py`` as extra dense rows, and (token
  eviction with ``demote=``) the demote tier's stores (``Tier``).
- ``PrecisionKV`` (compressed and simulate modes, verification calls only): dense K/V with those column
  sets appended; the attention function extends the mask and runs the model's own implementation.
- ``DenseKV`` (the ``dense-fp16-kernel`` / ``dense-bf16-kernel`` baselines): the layer's 16-bit K/V rows as
  stored; the native kernel attends over them (``fused.native_glue.native_dense_attention``).

Both need tqbench's attention function (``fused.install_fused_attention``, registered as ``ATTN_NAME``):
reaching any other attention code they raise a ``TypeError`` that says so.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tqbench.engine.cache.precision import Precision
from tqbench.engine.cache.store import KVStore

__all__ = ["ATTN_NAME", "DenseKV", "EvictKV", "FusedKV", "PrecisionKV", "Tier", "snapshot"]

#: the attention implementation name tqbench registers with transformers (``fused.install``)
ATTN_NAME = "tqbench_fused"

_MISUSE = ("a {mode}-mode TQCache handed {what} to {name}, which needs dense K/V: the model's attention is not "
           "{whose}; call tqbench.engine.cache.fused.install_fused_attention(model) (Engine.make_cache does) "
           "before generating{hint}")


class _Handle:
    _mode = "fused"
    _what = "its packed store"
    _whose = "the fused one"
    _hint = ", or use cache mode compressed"

    @classmethod
    def _misuse(cls, name: str) -> TypeError:
        return TypeError(_MISUSE.format(mode=cls._mode, what=cls._what, name=name, whose=cls._whose, hint=cls._hint))

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise cls._misuse(getattr(func, "__name__", str(func)))

    def __getitem__(self, item):
        raise self._misuse("an attention function")


@dataclass(frozen=True)
class Tier:
    """A fused call's demote tier: the K and V stores of the evicted rows (at ``policy.demote``) and their
    ``snapshot`` parts. Every tier row is older than any query of the call (no causal mask on them)."""

    k_store: KVStore
    v_store: KVStore
    k_parts: tuple
    v_parts: tuple

    @property
    def rows(self) -> int:
        return sum(p[1] for p in self.k_parts)


@dataclass
class FusedKV(_Handle):
    """What a fused-mode layer hands to the attention function instead of dense K/V."""

    k_store: KVStore
    v_store: KVStore
    new_k: torch.Tensor
    new_v: torch.Tensor
    # stored rows as of this call (captured before the new rows were appended)
    k_parts: tuple
    v_parts: tuple
    layer: object
    # a verification call's column sets (``precision.py``): dense rows read after ``new_k``/``new_v``
    extra_k: torch.Tensor | None = None
    extra_v: torch.Tensor | None = None
    precision: Precision | None = None
    #: token eviction: None, or whether this call ends at an eviction point (the attention function then hands
    #: the layer its queries: ``TQLayer.after_attention``)
    evict_point: bool | None = None
    #: a ragged layer (heads=ada, per-head keeps): one ``FusedKV`` per KV head (its own store, its rows of this
    #: call, its own demote tier), each its own row count (``fused.ragged_heads``); the layer's
    #: ``k_parts``/``v_parts`` are then empty
    ragged: list | None = None
    #: the demote tier (``policy.demote``): the evicted rows' K and V stores at the cheaper codec and their parts
    #: as of this call (``Tier``), attended before the held rows in the same softmax; None when there is none
    tier: Tier | None = None
    #: a plain layer's decode step (``step.fused_step``): ``(k_sides, v_sides, total_rows, extra_bytes, compute
    #: dtype)``, the kernel sides already pointed at this call's rows (``native_glue.store_sides`` hands them on)
    sides: tuple | None = None

    @property
    def shape(self) -> torch.Size:  # what code that inspects key.shape expects (the tier's rows included)
        b, h, t, d = self.new_k.shape
        return torch.Size((b, h, self.tier_rows + self.k_store_tokens + t, d))

    @property
    def tier_rows(self) -> int:
        return 0 if self.tier is None else self.tier.rows

    @property
    def k_store_tokens(self) -> int:
        if self.ragged is not None:  # the most rows a head reads before the call's (its demote tier's, then held)
            return max((kv.tier_rows + kv.k_store_tokens for kv in self.ragged), default=0)
        return sum(p[1] for p in self.k_parts)

    @property
    def extra_rows(self) -> int:
        return 0 if self.extra_k is None else self.extra_k.shape[2]


@dataclass
class PrecisionKV(_Handle):
    """A compressed/simulate-mode verification call: dense K/V (``[..., total + extra, D]``) and its plan."""

    keys: torch.Tensor
    values: torch.Tensor
    total: int  # columns of the call's own mask; the rest are the plan's column sets
    precision: Precision
    layer: object
    _mode = "compressed/simulate"
    _whose = "tqbench's"
    _what = "a speculative verification call (each draft token reads keys at its own precision)"
    _hint = ", or use cache mode dense-shadow or fused"

    @property
    def shape(self) -> torch.Size:
        b, h, _, d = self.keys.shape
        return torch.Size((b, h, self.total, d))


@dataclass
class EvictKV(_Handle):
    """A compressed/simulate-mode call of a layer that evicts tokens: dense K/V as the model's attention reads
    them; the attention function then hands the layer the call's queries (``TQLayer.after_attention``), which
    score the rows at an eviction point."""

    keys: torch.Tensor
    values: torch.Tensor
    layer: object
    evict_point: bool | None  # None: not an eviction point and no queries needed (a ragged layer's other calls)
    #: heads=ada: the rows each KV head held before this call (``keys`` holds them first, then padding up to
    #: the most any head holds, then the call's rows); the attention function masks each head's padding
    lengths: list[int] | None = None
    _mode = "compressed/simulate"
    _whose = "tqbench's"
    _what = "a call of a layer that evicts tokens (its scores read the call's queries)"
    _hint = ""

    @property
    def shape(self) -> torch.Size:
        return self.keys.shape


@dataclass
class DenseKV(_Handle):
    """A kernel-attended dense baseline's call: every row the call attends (history + this call's rows), stored in
    16 bits (``[B, H, rows, D]``, unit last stride); the attention function hands them to the native kernel."""

    keys: torch.Tensor
    values: torch.Tensor
    layer: object

    @classmethod
    def _misuse(cls, name: str) -> TypeError:
        return TypeError(f"a kernel-attended dense baseline handed its 16-bit rows to {name}, which needs dense "
                         "K/V: the model's attention is not tqbench's; call "
                         "tqbench.engine.cache.fused.install_fused_attention(model) (Engine.make_cache does) before "
                         "generating, or use the dense-fp16 baseline (attention on the upcast rows)")

    @property
    def shape(self) -> torch.Size:
        return self.keys.shape


def snapshot(store: KVStore) -> tuple:
    """(kind, n_tokens, payload) parts in token order, for the fused attention path."""
    parts = []
    if store.head.n:
        parts.append(("dense", store.head.n, store.head.view()))
    if store.n_packed:
        parts.append(("packed", store.n_packed, store.packed_view()))
    if store.tail.n:
        parts.append(("dense", store.tail.n, store.tail.view()))
    return tuple(parts)
