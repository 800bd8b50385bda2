"""Batched decode steps: sequences that share a model decode together, one forward call per step.

Each ``Sequence`` keeps its own cache (its own compressed rows, its own length). A step stacks every
sequence's ``next_token`` into one ``[B, 1]`` call: embeddings, projections, MLPs and the LM head run once
for the batch; in each attention layer ``_RowsLayer`` hands every sequence's new K/V row to that sequence's
own cache layer, which returns its history as it stores it (exactly what a solo step reads), and left-pads
the histories to the longest one. A 2D attention mask hides the padding and per-sequence ``position_ids``
keep the rotary positions of a solo run, so a batched step computes what the solo steps compute (equal
tokens in float64; in float32 the batch's different summation order can flip a near tie).

Sequences join and leave between steps: a batch view is built afresh for every step.

What batches: caches whose every layer is a ``TQLayer``, in any mode. Modes that return dense K/V
(compressed, simulate, dense-shadow) get the left-padded histories above; the fused mode gets no dense
history at all: each layer hands the attention a ``FusedBatch`` of every sequence's own packed-store handle,
and the fused attention answers each sequence from its own store with its own length and mask row (no codes
padded to the longest). ``why_not_batched`` names what does not batch (a dense sliding-window layer bounds
its own history), and those sequences decode one per forward call.
"""

from __future__ import annotations

import time

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from tqbench.engine.cache.fused.batch_kv import FusedBatch
from tqbench.engine.cache.tqcache import FusedKV, TQCache, TQLayer
from tqbench.engine.generate import Sequence, _forward

__all__ = ["decode_step", "why_not_batched"]


def why_not_batched(cache) -> str | None:
    """None when sequences with this kind of cache can share a forward call; else the reason they cannot."""
    if not isinstance(cache, TQCache):
        return f"a {type(cache).__name__} is not a TQCache"
    if not all(isinstance(layer, TQLayer) for layer in cache.layers):
        return "the policy keeps dense sliding-window layers, which bound their own history"
    if any(layer.evictor is not None for layer in cache.layers):
        return ("the policy evicts tokens (keep): its layers hold fewer rows than the sequence's length, which "
                "the batch's one attention mask cannot follow")
    return None


class _RowsLayer(CacheLayerMixin):
    """One attention layer of a batch: row b goes to sequence b's own layer; histories left-padded."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, members: list, width: int) -> None:
        super().__init__()
        self.members = members
        self.width = width  # the longest history in the batch
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        total = self.width + key_states.shape[2]
        keys = values = None
        handles = []
        for b, member in enumerate(self.members):
            k, v = member.update(key_states[b : b + 1], value_states[b : b + 1], *args, **kwargs)
            if isinstance(k, FusedKV):  # fused: each sequence's own store handle, no dense history
                handles.append(k)
                continue
            if keys is None:  # zeros under the padding (masked out), each history right-aligned
                keys = k.new_zeros((len(self.members), k.shape[1], total, k.shape[3]))
                values = v.new_zeros((len(self.members), v.shape[1], total, v.shape[3]))
            keys[b, :, total - k.shape[2] :] = k[0]
            values[b, :, total - v.shape[2] :] = v[0]
        if handles:
            if len(handles) != len(self.members):
                raise ValueError("a batch mixes fused and dense cache layers: batch one cache mode per step")
            batch = FusedBatch(handles, self.width)
            return batch, batch
        return keys, values

    def lazy_initialization(self, key_states, value_states) -> None:
        return None

    def get_seq_length(self) -> int:
        return self.width

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.width + query_length, 0

    def get_max_length(self) -> int:
        return -1


class _BatchView(Cache):
    """A transformers ``Cache`` over several sequences' caches, for one forward call."""

    def __init__(self, caches: list, width: int) -> None:
        layers = [_RowsLayer([c.layers[i] for c in caches], width) for i in range(len(caches[0].layers))]
        super().__init__(layers=layers)


def decode_step(model, seqs: list[Sequence]) -> float:
    """Run the forward call over every sequence's ``next_token``, feed each its logits; returns the seconds.

    One sequence runs exactly as ``stream_tokens`` runs it. Several must all be batchable
    (``why_not_batched``) and share the model; each reads only its own cache.
    """
    live = [s for s in seqs if s.next_token is not None]
    if not live:
        return 0.0
    device = live[0].device
    t0 = time.perf_counter()
    if len(live) == 1:
        s = live[0]
        logits = _forward(model, torch.tensor([[s.next_token]], device=device), s.cache).logits[0, -1]
        dt = time.perf_counter() - t0
        s.feed(logits, dt)
        return dt
    for s in live:
        reason = why_not_batched(s.cache)
        if reason is not None:
            raise ValueError(f"sequence {s.run!r} cannot decode in a batch: {reason}")
    lengths = [s.cache.get_seq_length() for s in live]
    width = max(lengths)
    ids = torch.tensor([[s.next_token] for s in live], device=device)
    mask = torch.zeros(len(live), width + 1, dtype=torch.long, device=device)
    for b, n in enumerate(lengths):
        mask[b, width - n :] = 1
    positions = torch.tensor([[n] for n in lengths], device=device)
    out = _forward(model, ids, _BatchView([s.cache for s in live], width), attention_mask=mask,
                   position_ids=positions)
    dt = time.perf_counter() - t0
    for b, s in enumerate(live):
        s.feed(out.logits[b, -1], dt)
    return dt
