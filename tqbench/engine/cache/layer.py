"""``TQLayer``: one attention layer's compressed cache, in one of four modes (see ``tqcache.py``).

Every forward call appends its rows to the K and V stores. A call attends exactly over its own rows and reads
the history as stored, except a speculative verification call (past recording on, ``activate_past_recording``):
its rows past the prompt are decode rows, each its own store point, and each of its queries reads every key at
the precision it would have read decoding one token at a time (``precision.py``). ``crop`` takes the layer
back to fewer tokens exactly (``KVStore.crop``); ``reorder_cache`` / ``batch_select_indices`` /
``batch_repeat_interleave`` serve beam search and ``num_return_sequences``.
"""

from __future__ import annotations

import math

import torch
from transformers.cache_utils import CacheLayerMixin

from tqbench.constants import CACHE_MODES
from tqbench.engine.cache.evict.ragged import RaggedStore, check_ragged_codec, pad_rows
from tqbench.engine.cache.evict.state import EVICT_NO_CROP, Evictor
from tqbench.engine.cache.geometry import window_rows
from tqbench.engine.cache.handles import EvictKV, FusedKV, PrecisionKV, Tier, snapshot
from tqbench.engine.cache.precision import plan_precision, quantized_rows, rows_in_parts, set_rows
from tqbench.engine.cache.step import append_step, fused_step
from tqbench.engine.cache.store import KVStore
from tqbench.engine.policy.spec import LayerPlan, Policy

__all__ = ["TQLayer", "check_mode"]


def check_mode(mode: str) -> str:
    if mode not in CACHE_MODES:
        raise ValueError(f"unknown cache mode {mode!r}: valid modes are {', '.join(CACHE_MODES)}")
    return mode


def _put_dequantized(rows: torch.Tensor | None, store: KVStore, packed: list, offset: int = 0) -> None:
    """Write the dequantized values of ``packed`` (``(position, encoded)`` chunks from ``store.append``) over
    their rows in ``rows``, whose first row is the token at position ``offset`` (rows before it are skipped):
    the simulate mode's one rule."""
    for start, enc in packed:
        deq = store.codec.decode(enc, store.state, rows.dtype)
        a = max(start, offset)
        if a < start + deq.shape[2]:
            rows[:, :, a - offset : start - offset + deq.shape[2]] = deq[:, :, a - start :]


class TQLayer(CacheLayerMixin):
    """One attention layer's compressed cache."""

    is_sliding = False
    is_compileable = False
    is_croppable = True

    def __init__(self, plan: LayerPlan, mode: str, policy: Policy, sliding_window: int | None = None,
                 kv_heads: int | None = None) -> None:
        super().__init__()
        self.plan = plan
        self.mode = check_mode(mode)
        self.policy = policy
        # (per-KV-head lists: K and V over the same groups of heads, each list checked against ``kv_heads``)
        self.k_codec, self.v_codec = policy.layer_codecs(plan, kv_heads)
        # a sliding-window layer: attention reads the last window - 1 stored rows (as transformers'
        # DynamicSlidingWindowLayer keeps them), the stores hold at most a codec unit more
        self.window = window_rows(sliding_window) if plan.sliding else None
        self.is_sliding = self.window is not None
        self.align = math.lcm(self.k_codec.tokens_per_unit, self.v_codec.tokens_per_unit)
        self.cumulative_length = 0
        #: speculative decoding (``activate_past_recording``): rows at positions >= ``prefill_end`` are decode rows
        self.record_past = False
        self.prefill_end: int | None = None
        self.verify_calls = 0  # calls in which a query read rows packed during the call quantized (``precision``)
        self.kv_heads = kv_heads
        self._new_stores()
        self.fused_calls = 0
        self.fallbacks: dict[str, int] = {}
        self.fused_impl: dict[str, int] = {}  # "native-cpu" / "triton" / "torch-reference (why)" -> calls
        self.fused_groups: dict[str, dict[str, int]] = {}  # per-head layers: group ("k=.. v=.. heads ..") -> impl -> calls
        self.native_workspace = 0  # largest transient bytes of one native call (partials + full-precision rows)
        self.sparse_v_rows = [0, 0]  # Sparse-V: value rows skipped, value rows with weight (native kernel)

    shared_budget = None  # budget=global: the cache's ``evict.global_budget.GlobalBudget`` (``TQCache`` sets it)

    def _new_stores(self) -> None:
        #: token eviction (``policy.keep``) on this layer, else None
        self.evictor = Evictor(self.plan, self.policy, self.mode, self.kv_heads) if self.plan.evicts else None
        if self.evictor is not None and self.shared_budget is not None:  # budget=global (set by the cache)
            self.evictor.shared = self.shared_budget
            self.shared_budget.clear()
        if self.evictor is not None and self.evictor.ragged:  # one store per KV head (its own codec), ragged rows
            pol, plan = self.policy, self.plan
            for h in range(self.kv_heads or 0):  # (checked here when the heads are known; else at the first rows)
                for role in ("k", "v"):
                    check_ragged_codec(pol.head_codec(plan, role, h), role)
            self.k_store, self.v_store = (
                RaggedStore(codec, plan.sink, plan.recent, role=role,
                            head_codec=lambda h, role=role: pol.head_codec(plan, role, h))
                for codec, role in ((self.k_codec, "k"), (self.v_codec, "v")))
        else:
            self.k_store = KVStore(self.k_codec, self.plan.sink, self.plan.recent, self.window, self.align)
            self.v_store = KVStore(self.v_codec, self.plan.sink, self.plan.recent, self.window, self.align)
        #: a fused layer with no eviction and packed codecs: its calls take ``_fused_step`` (unless recording the past)
        self._plain_fused = self.mode == "fused" and self.evictor is None and not self.lossless
        self._step = None  # its kept step (``step.fused_step``: the kernel sides and the native step over the buffers)
        self._sim = {"k": None, "v": None}  # simulate: dense rows attention reads, from position _sim_start
        self._sim_start = {"k": 0, "v": 0}
        self._sim_pending: dict[str, list] = {}

    def __getstate__(self) -> dict:
        """Copies (``copy.deepcopy``: a compressed context forked per question) and pickles leave out the kept decode
        step (native, not copyable; its sides and buffers are the original's): the copy makes its own."""
        state = self.__dict__.copy()
        state["_step"] = None
        return state

    @property
    def ragged(self) -> bool:
        """heads=ada or a per-head keep list: each KV head holds its own rows (``evict.ragged``)."""
        return self.evictor is not None and self.evictor.ragged

    @property
    def lossless(self) -> bool:
        return self.k_codec.lossless and self.v_codec.lossless

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.dtype = key_states.dtype
        self.v_dim = value_states.shape[-1]
        self.keys = key_states.new_empty((0,))
        self.values = value_states.new_empty((0,))
        self.is_initialized = True

    # -- speculative decoding ---------------------------------------------------------------------
    def activate_past_recording(self, prefill_end: int | None = None) -> None:
        """Verification calls from now on: rows at positions >= ``prefill_end`` (default: the tokens held now)
        are decode rows, each read by the call's later queries as one-at-a-time decoding would; every call
        can be cropped back exactly."""
        self.record_past = True
        self.prefill_end = self.cumulative_length if prefill_end is None else prefill_end

    def _points(self, t: int) -> tuple[list[int] | None, int]:
        """This call's store points and its first decode query (``t``: none)."""
        if not self.record_past:
            return None, t
        first = min(max(self.prefill_end - self.cumulative_length, 0), t)
        return ([first] if first else []) + list(range(first + 1, t + 1)), first

    # -- the forward call ---------------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        elif self._plain_fused and not self.record_past:  # a fused call of a plain layer: the step's path
            return self._fused_step(key_states, value_states)
        mode = "compressed" if (self.lossless and self.mode != "dense-shadow") else self.mode
        if self.ragged and mode == "simulate":  # the same rows as compressed: a ragged layer keeps no dense buffer
            mode = "compressed"
        # (a ragged layer: the rows each head reads before the call's, demoted then held; none before the first rows)
        lengths = (self.evictor.head_spans(self.k_store) or None) if self.ragged else None
        n0, t = self.cumulative_length, key_states.shape[2]
        # rows attention reads: the stored history (the last window - 1 on a sliding layer) + this call's
        visible = t + (n0 if self.window is None else min(n0, self.window))
        evictor, point = self.evictor, False
        if evictor is not None:  # the rows each head still holds; at an eviction point the stores pack after scoring
            visible = t + evictor.span(self.k_store)
            point = evictor.begin(n0, t, key_states.shape[0], key_states.shape[1], key_states.device)
            self.k_store.defer = self.v_store.defer = point
        points, first = self._points(t)
        if self.record_past:
            self.k_store.mark()
            self.v_store.mark()
        cut0 = (self.k_store.tail_start, self.v_store.tail_start)
        if mode == "dense-shadow":  # attention reads exact rows: every query reads every key as decoding would
            out = self._dense_shadow(key_states, value_states, visible)
            self.k_store.append_points(key_states, points)
            self.v_store.append_points(value_states, points)
        elif mode in ("simulate", "compressed"):
            if mode == "simulate":
                base_k, ck, cuts_k = self._simulate(key_states, "k", points)
                base_v, cv, cuts_v = self._simulate(value_states, "v", points)
            else:
                base_k = self._with_history(self.k_store, key_states, "k")
                base_v = self._with_history(self.v_store, value_states, "v")
                ck, cuts_k = self.k_store.append_points(key_states, points)
                cv, cuts_v = self.v_store.append_points(value_states, points)
            base_k, base_v = base_k[:, :, -visible:], base_v[:, :, -visible:]
            plan = self._plan(n0, first, cut0, (cuts_k, cuts_v), points, n0 + t - visible)
            if plan is None:
                out = (base_k, base_v)
            else:
                c0 = plan.lo - (n0 + t - visible)
                base = (base_k[:, :, c0 : c0 + plan.width], base_v[:, :, c0 : c0 + plan.width])
                ek, ev = self._set_rows(plan, base, (ck, cv))
                handle = PrecisionKV(torch.cat([base_k, ek], dim=2), torch.cat([base_v, ev], dim=2), visible,
                                     plan, self)
                out = (handle, handle)
        elif self.ragged:  # fused, ragged heads: each KV head its own store (one kernel call: fused.ragged_heads)
            views = [FusedKV(ks, vs, key_states[:, h : h + 1], value_states[:, h : h + 1], snapshot(ks),
                             snapshot(vs), self) for h, (ks, vs) in enumerate(zip(self.k_store.stores,
                                                                                  self.v_store.stores))]
            if evictor.demoted:  # each head's demote tier, read before its held rows
                for view, dk, dv in zip(views, *(d.stores for d in evictor.demoted)):
                    if dk.n_tokens:
                        view.tier = Tier(dk, dv, snapshot(dk), snapshot(dv))
            handle = FusedKV(self.k_store, self.v_store, key_states, value_states, (), (), self, ragged=views)
            self.k_store.append_points(key_states, points)
            self.v_store.append_points(value_states, points)
            out = (handle, handle)
        else:  # fused
            handle = FusedKV(self.k_store, self.v_store, key_states, value_states,
                             snapshot(self.k_store), snapshot(self.v_store), self)
            if evictor is not None and evictor.n_demoted:  # the demote tier, read before the held rows
                dk, dv = evictor.demoted
                handle.tier = Tier(dk, dv, snapshot(dk), snapshot(dv))
            first_held = (self.k_store.dropped, self.v_store.dropped)
            keep = points is not None  # (only a verification call's plan reads the chunks packed)
            ck, cuts_k = self.k_store.append_points(key_states, points, keep)
            cv, cuts_v = self.v_store.append_points(value_states, points, keep)
            plan = self._plan(n0, first, cut0, (cuts_k, cuts_v), points, n0 - handle.k_store_tokens)
            if plan is not None:
                base = tuple(
                    rows_in_parts((*parts, ("dense", t, new)), start, plan.lo, plan.lo + plan.width, store, new.dtype)
                    for parts, start, store, new in ((handle.k_parts, first_held[0], self.k_store, key_states),
                                                     (handle.v_parts, first_held[1], self.v_store, value_states)))
                handle.extra_k, handle.extra_v = self._set_rows(plan, base, (ck, cv))
                handle.precision = plan
            out = (handle, handle)
        if evictor is not None and evictor.observes(point):
            if mode == "fused":
                out[0].evict_point = point
            else:
                handle = EvictKV(out[0], out[1], self, point, lengths)
                out = (handle, handle)
        elif lengths is not None and mode != "fused":  # compressed/simulate: each head's padding masked
            handle = EvictKV(out[0], out[1], self, None, lengths)
            out = (handle, handle)
        self.cumulative_length += t
        return out

    def _fused_step(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """``update`` of a fused call on a plain layer (no eviction, not lossless, no past recording): one native call
        where the stores allow it (``step.fused_step``: the kernel sides pointed at the rows as of the call, the rows
        appended); else the stores' parts as of the call, then this call's rows appended to both stores by one native
        call (``step.append_step``) or store by store. The same handle, the same stores, as the general branch."""
        handle = fused_step(self, key_states, value_states)
        if handle is not None:
            self.cumulative_length += key_states.shape[2]
            return handle, handle
        ks, vs = self.k_store, self.v_store
        handle = FusedKV(ks, vs, key_states, value_states, snapshot(ks), snapshot(vs), self)
        if not append_step((ks, vs), (key_states, value_states)):
            ks.append_points(key_states, None, False)
            vs.append_points(value_states, None, False)
        self.cumulative_length += key_states.shape[2]
        return handle, handle

    def after_attention(self, query: torch.Tensor, scaling: float, point: bool) -> None:
        """Token eviction: this call's queries (tqbench's attention function calls this after the call's
        attention); at an eviction point the layer's rows are scored and cut, then packed."""
        self.evictor.after_attention(self, query, scaling, point)
        if point and self.mode == "simulate" and not self.ragged:  # the dense buffer follows the store's rows
            n_demoted = self.evictor.n_demoted
            for role, store in (("k", self.k_store), ("v", self.v_store)):
                parts = [p for p in (self.evictor.demoted_dense(role, query.dtype), store.dense(query.dtype))
                         if p is not None]
                self._sim[role] = torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]
                self._sim_start[role] = store.tail_start - store.head.n - store.n_packed - n_demoted
                self._sim_pending[role] = []

    def _plan(self, n0: int, first: int, cut0: tuple, cuts: tuple, points: list | None, lowest_visible: int):
        """Per-query precision of a verification call (None when every query reads what its first one reads)."""
        if points is None:
            return None
        t = points[-1]
        per_query = []
        for side_cuts, side_cut0 in zip(cuts, cut0):
            at = dict(zip(points, side_cuts))
            # query i reads the store after i rows of the call (i = 0: as it was before the call)
            per_query.append([side_cut0 if i == 0 else at.get(i, side_cut0) for i in range(t)])
        plan = plan_precision(n0, first, cut0, (per_query[0], per_query[1]), lowest_visible)
        if plan is not None:
            self.verify_calls += 1
        return plan

    def _set_rows(self, plan, base: tuple, chunks: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        quant = tuple(quantized_rows(b, plan.lo, c, store, b.dtype)
                      for b, c, store in zip(base, chunks, (self.k_store, self.v_store)))
        return set_rows(plan, base, quant)

    def _dense_shadow(self, key_states: torch.Tensor, value_states: torch.Tensor, visible: int):
        shape_k = (*key_states.shape[:2], -1, key_states.shape[3])
        shape_v = (*value_states.shape[:2], -1, value_states.shape[3])
        keys = torch.cat([self.keys.view(shape_k), key_states], 2)
        values = torch.cat([self.values.view(shape_v), value_states], 2)
        out = (keys[:, :, -visible:], values[:, :, -visible:])
        if self.window is None:
            self.keys, self.values = keys, values
        else:  # the rows this call read: at least the window after a crop of this call's rows
            self.keys, self.values = out
        return out

    def _with_history(self, store: KVStore, new: torch.Tensor, role: str) -> torch.Tensor:
        if self.ragged:  # each head's demoted then held rows, first; padding up to the most any head reads
            held = store.head_dense(new.dtype)
            tier = self.evictor.demoted_heads(role, new.dtype, len(held))
            rows = pad_rows([torch.cat([d, x], dim=2) if d is not None and x is not None else (x if d is None else d)
                             for d, x in zip(tier, held)])
            return new if rows is None else torch.cat([rows, new], dim=2)
        parts = [store.dense(new.dtype), new]
        if self.evictor is not None:  # demoted rows (policy.demote) first
            parts.insert(0, self.evictor.demoted_dense(role, new.dtype))
        parts = [p for p in parts if p is not None]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)

    def _simulate(self, new: torch.Tensor, role: str, points: list | None):
        """Dense buffer of what attention reads. Rows packed by a call are swapped for their dequantized values
        at the start of the next call (the call itself reads them as its queries would, as the other modes
        do), so the buffer is never copied; it follows the store's rows (a window-bounded store evicts)."""
        store = self.k_store if role == "k" else self.v_store
        buf, start = self._sim[role], self._sim_start[role]
        if buf is not None and store.dropped > start:
            buf, start = buf[:, :, store.dropped - start :], store.dropped
        if buf is not None:
            _put_dequantized(buf, store, self._sim_pending.pop(role, ()), start)
        else:
            start = self.cumulative_length
        out = new if buf is None else torch.cat([buf, new], dim=2)
        chunks, cuts = store.append_points(new, points)
        self._sim_pending[role] = chunks
        self._sim[role], self._sim_start[role] = out, start
        return out, chunks, cuts

    def append_read_quantized(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """The seed wrapper's simulate (``CompressedDynamicCache``): append this call's rows to the stores and
        return them as stored, every row packed by this call already dequantized (so this call, prefill
        included, reads quantized values). No dense buffer is kept: the caller holds the returned rows."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        out = []
        for store, new in ((self.k_store, key_states), (self.v_store, value_states)):
            offset = store.seen
            packed = store.append(new)
            rows = new.clone() if packed else new
            _put_dequantized(rows, store, packed, offset)
            out.append(rows)
        self.cumulative_length += key_states.shape[2]
        return out[0], out[1]

    # -- transformers layer protocol ------------------------------------------------------------
    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if self.evictor is not None:  # the held rows, all before the call's (their own positions: any order)
            held = self.evictor.span(self.k_store)
            return held + query_length, self.cumulative_length - held
        if self.window is not None:  # as transformers' DynamicSlidingWindowLayer: the last window - 1 rows
            return min(self.cumulative_length, self.window) + query_length, max(self.cumulative_length - self.window, 0)
        return self.cumulative_length + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.cumulative_length = 0
        self._new_stores()
        self.keys = self.values = None
        self.is_initialized = False
        self.record_past, self.prefill_end = False, None

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens, leaving every store exactly as if they had never been
        appended (``KVStore.crop``). Raises when that cannot be done exactly (tokens packed before the last
        call, without past recording)."""
        if tokens_to_remove > 0:
            raise ValueError(
                f"Calling `crop` with a positive value (`{tokens_to_remove}`) is not supported. "
                "Please use a negative integer to remove that number of tokens from the cache instead.")
        if not self.is_initialized or tokens_to_remove == 0:
            return
        if self.evictor is not None:
            raise ValueError(EVICT_NO_CROP)
        keep = max(0, self.cumulative_length + tokens_to_remove)
        ck = self.k_store.crop(keep)
        cv = self.v_store.crop(keep)
        gone = self.cumulative_length - keep
        self.cumulative_length = keep
        if self.mode == "dense-shadow" and self.keys.dim() == 4:
            self.keys, self.values = self.keys[:, :, : self.keys.shape[2] - gone], self.values[:, :, : self.values.shape[2] - gone]
        for role, chunks in (("k", ck), ("v", cv)):
            buf = self._sim[role]
            if buf is not None:  # simulate: the buffer's cropped rows go; rows packed again are swapped in next call
                self._sim[role] = buf[:, :, : max(0, keep - self._sim_start[role])]
                if chunks is not None:
                    self._sim_pending[role] = chunks

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if not self.is_initialized:
            return
        for store in (self.k_store, self.v_store):
            store.select_batch(indices)
        self._map_dense(lambda t: t.index_select(0, indices.to(t.device)))
        if self.evictor is not None:
            self.evictor.map_batch(lambda t: t.index_select(0, indices.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if not self.is_initialized:
            return
        for store in (self.k_store, self.v_store):
            store.repeat_batch(repeats)
        self._map_dense(lambda t: t.repeat_interleave(repeats, dim=0))
        if self.evictor is not None:
            self.evictor.map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def _map_dense(self, fn) -> None:
        for role in ("k", "v"):
            if self._sim[role] is not None:
                self._sim[role] = fn(self._sim[role])
            if role in self._sim_pending:  # rows still to be swapped in belong to the sequences they came from
                self._sim_pending[role] = [(start, {k: fn(t) for k, t in enc.items()})
                                           for start, enc in self._sim_pending[role]]
        if self.keys is not None and self.keys.dim() == 4:
            self.keys, self.values = fn(self.keys), fn(self.values)

    def offload(self) -> None:  # the packed store stays where it is
        return None

    def prefetch(self) -> None:
        return None

    def note_fallback(self, case: str) -> None:
        self.fallbacks[case] = self.fallbacks.get(case, 0) + 1
