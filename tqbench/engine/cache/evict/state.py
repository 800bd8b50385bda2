"""``Evictor``: one compressed layer's token eviction (``policy.keep``).

Eviction points: the end of every call of more than one row (a prefill, or a prefill chunk), and with
``every`` > 0 every ``every`` decoded tokens after the last prefill call. At a point the layer's stores defer
packing (``KVStore.defer``): the call's rows are scored and cut while still exact, after the call's attention
(the scores read its queries, in tqbench's attention function), then the stores pack as usual. Each KV head
keeps ``kept_rows`` rows (the sinks and the last max(window, recent) rows always), its own, chosen by the
score; kept rows keep their positions (cached keys carry their rotary phase; nothing is re-rotated).
"""

from __future__ import annotations

import torch

from tqbench.engine.cache.buffer import GrowBuffer
from tqbench.engine.cache.evict import scores
from tqbench.engine.cache.evict.bookkeeping import MASS_DTYPE, POSITION_DTYPE
from tqbench.engine.cache.evict.compact import EvictionError, _take, compact_store
from tqbench.engine.cache.evict.ragged import (
    PAD_POSITION,
    HeadRows,
    RaggedStore,
    cost_groups,
    pad_rows,
    select_ada,
)
from tqbench.engine.cache.store import KVStore
from tqbench.engine.policy.keep import head_keeps, kept_rows, protected_rows

__all__ = ["EVICT_NO_CROP", "EvictionError", "Evictor"]

#: why a layer that evicts tokens cannot be cropped (speculative decoding's rejected drafts)
EVICT_NO_CROP = ("speculative decoding cannot run with token eviction (keep): a crop after a rejected draft must "
                 "restore the rows an eviction dropped, and they are gone; decode without speculation, or use a "
                 "policy without keep")



def select_kept(score: torch.Tensor, held: int, target: int, head: int, tail: int) -> torch.Tensor:
    """Ordinals [B, H, target] (sorted) of the rows each KV head keeps out of ``held``: the first ``head`` and the
    last ``tail`` always, the best-scored (``score`` [B, H, held], higher: keep) of the rows between them."""
    sel = score[..., head : held - tail].topk(target - head - tail, dim=-1).indices.sort(dim=-1).values + head
    b, h = sel.shape[:2]
    dev = sel.device
    return torch.cat([torch.arange(head, device=dev).expand(b, h, head), sel,
                      torch.arange(held - tail, held, device=dev).expand(b, h, tail)], dim=2)


def _gone(idx: torch.Tensor, held: int) -> torch.Tensor:
    """The sorted ordinals ``[B, 1, held - n]`` of the rows ``idx`` ``[B, 1, n]`` does not keep."""
    b = idx.shape[0]
    gone = torch.ones(b, 1, held, dtype=torch.bool, device=idx.device)
    gone.scatter_(2, idx, False)
    return gone.nonzero()[:, 2].view(b, 1, held - idx.shape[2])


class Evictor:
    def __init__(self, plan, policy, mode: str, kv_heads: int | None = None) -> None:
        self.keep, self.sink, self.recent = plan.keep, plan.sink, plan.recent
        self.score, self.window, self.every = policy.score, policy.window, policy.every
        self.chunk = policy.chunk
        #: the ranking (``scores.get_score``: the policy's score, chunked when ``chunk`` > 1)
        self.ranker = scores.get_score(self.score, self.chunk)
        #: a context-pass score's per-position scores [B, H, N] (``set_rows``; kvzip), else None
        self.rows: torch.Tensor | None = None
        #: no eviction point at a multi-row call (``freeze``: a compressed context whose questions append)
        self.frozen = False
        if mode == "fused" and self.ranker.accumulates and self.every:
            raise EvictionError(
                "score=h2o with every= accumulates every decoded query's attention over the held rows, which the "
                "fused kernel does not return: use score=tova or snapkv (they read the queries at each eviction), "
                "or cache mode compressed")
        if mode == "dense-shadow":
            raise EvictionError("token eviction (keep) runs in cache modes compressed, simulate and fused: "
                                "dense-shadow attends over every exact row by definition")
        #: a ragged layer: each KV head holds its own rows (``ragged.RaggedStore``), chosen by ``select_ada``
        #: (heads=ada) or each head by its own keep fraction (``head_keep``: a per-head keep list, else None)
        self.ragged = policy.ragged(plan)
        self.head_keep = plan.keep if plan.head_keeps else None
        if self.head_keep is not None and kv_heads is not None:
            head_keeps(self.head_keep, kv_heads, plan.layer)
        self.layer_index = plan.layer
        self.kv_heads = kv_heads
        self.ada_floor = policy.ada_floor
        #: budget=global: the cache-wide choice of each head's row count (``global_budget.GlobalBudget``), else None
        self.shared = None
        self.positions = GrowBuffer()  # [B, H, held]: each held row's token position (ragged: ``HeadRows``)
        self.mass = GrowBuffer()  # h2o: [B, H, held] attention mass received
        self.queries: torch.Tensor | None = None  # the last ``window`` queries [B, Hq, <=window, D]
        self.prefill_end = 0
        self.evicted_prefill = 0  # rows each KV head dropped at prefill points
        self.evicted_decode = 0  # ... at decode points (every)
        self.points = 0
        #: demote: the evicted rows of K and V, kept at the layer's cheaper codec (``plan.demote``: ``policy.demote``
        #: or a ``demote@`` override), else None
        self.demoted: tuple[KVStore, KVStore] | None = None
        if plan.demote and self.ragged:  # each head's evicted rows in its own store (its codec state its own)
            self.demoted = tuple(RaggedStore(
                policy.build_codec(plan.demote, role, layer=plan.layer), 0, 0, role=role,
                head_codec=lambda h, role=role: policy.build_codec(plan.demote, role, layer=plan.layer, heads=(h,)))
                for role in ("k", "v"))
        elif plan.demote:
            self.demoted = tuple(KVStore(policy.build_codec(plan.demote, role, layer=plan.layer), 0, 0)
                                 for role in ("k", "v"))

    def bookkeeping_bytes(self) -> int:
        """Bytes of the held rows' positions and mass as held now (``evict.bookkeeping``'s rule)."""
        if self.ragged:
            return sum(b.nbytes() for b in (self.positions, self.mass) if isinstance(b, HeadRows))
        return sum(b.view().numel() * b.view().element_size() for b in (self.positions, self.mass)
                   if b.data is not None)

    def held_positions(self) -> torch.Tensor | None:
        """``[B, H, held]`` positions of the held rows (ragged: padded with ``PAD_POSITION``)."""
        if self.ragged:
            return self.positions.view(PAD_POSITION) if isinstance(self.positions, HeadRows) else None
        return self.positions.view()

    @property
    def n_demoted(self) -> int:
        """Demoted rows per KV head (a ragged layer: the mean over its heads)."""
        if not self.demoted:
            return 0
        if self.ragged:
            rows = self.demoted[0].rows
            return sum(rows) // len(rows) if rows else 0
        return self.demoted[0].n_tokens

    def head_spans(self, k_store) -> list[int]:
        """A ragged layer: the rows each KV head's attention reads before the call's (demoted, then held)."""
        held = k_store.rows
        tier = self.demoted[0].rows if self.demoted else []
        return [n + (tier[h] if h < len(tier) else 0) for h, n in enumerate(held)]

    def span(self, k_store) -> int:
        """The history columns attention reads: demoted then held rows (a ragged layer: the most any head reads,
        each head's padding masked)."""
        if self.ragged:
            return max(self.head_spans(k_store), default=0)
        return k_store.n_tokens + self.n_demoted

    def demoted_dense(self, role: str, dtype) -> torch.Tensor | None:
        """The demoted rows of K (``role`` "k") or V, dequantized (attention reads them before the held rows)."""
        return self.demoted[0 if role == "k" else 1].dense(dtype) if self.demoted else None

    def demoted_heads(self, role: str, dtype, heads: int) -> list:
        """A ragged layer's demoted rows per KV head (``[B, 1, n_h, D]`` or None), dequantized."""
        store = self.demoted[0 if role == "k" else 1] if self.demoted else None
        if store is None or not store.stores:
            return [None] * heads
        return [s.dense(dtype) for s in store.stores]

    def begin(self, n0: int, t: int, batch: int, heads: int, device) -> bool:
        """A call of ``t`` rows after ``n0`` tokens: record the positions; True when it ends at an eviction point."""
        pos = torch.arange(n0, n0 + t, dtype=POSITION_DTYPE, device=device).view(1, 1, t).expand(batch, heads, t)
        if self.head_keep is not None:
            head_keeps(self.head_keep, heads, self.layer_index)
        if self.ragged and not isinstance(self.positions, HeadRows):
            self.positions = HeadRows(heads)
            if self.ranker.accumulates:
                self.mass = HeadRows(heads)
        self.positions.append(pos)
        if self.ranker.accumulates:
            self.mass.append(torch.zeros(batch, heads, t, dtype=MASS_DTYPE, device=device))
        if t > 1:
            self.prefill_end = n0 + t
            return not self.frozen
        return bool(self.every and self.prefill_end and (n0 + t - self.prefill_end) % self.every == 0)

    def set_rows(self, rows: torch.Tensor | None) -> None:
        """A context-pass score's per-position scores ``[B, H, N]`` (kvzip), read at the next eviction point."""
        self.rows = rows

    def freeze(self, frozen: bool = True) -> None:
        """Frozen: a call of more than one row is no eviction point (the rows appended to a compressed context,
        a question, stay; decode points with ``every`` still run)."""
        self.frozen = frozen

    def observes(self, point: bool) -> bool:
        """Whether this call's queries are needed (an eviction point, or a score that accumulates them)."""
        return point or (self.every > 0 and (self.ranker.reads_window or self.ranker.accumulates))

    def after_attention(self, layer, query: torch.Tensor, scaling: float, point: bool) -> None:
        """Read this call's queries; at an eviction point, evict and let the stores pack."""
        t = query.shape[2]
        seen = layer.cumulative_length
        if self.ranker.reads_window:
            q = query.detach() if self.queries is None else torch.cat([self.queries, query.detach()], dim=2)
            self.queries = q[:, :, -self.window :]
        keys = None
        if self.ranker.accumulates and (point or self.every):
            keys = layer.k_store.dense(query.dtype)
            q_pos = torch.arange(seen - t, seen, device=query.device)
            mass = scores.h2o_mass(query, keys, scaling, q_pos, self.held_positions())
            if self.ragged:
                self.mass.add_(mass)
            else:
                self.mass.view().add_(mass)
        if point:
            self._evict(layer, query, scaling, seen, t, keys)

    def _evict(self, layer, query, scaling, seen: int, t: int, keys) -> None:
        ks, vs = layer.k_store, layer.v_store
        held = ks.n_tokens
        target = None if self.head_keep is not None else kept_rows(seen, self.keep, self.sink, self.window,
                                                                     self.recent)
        self.points += 1
        if self.ragged:
            self._evict_ragged(layer, query, scaling, seen, t, keys, target)
        elif target < held:
            head, tail = protected_rows(seen, self.sink, self.window, self.recent)
            if keys is None:
                keys = ks.dense(query.dtype)
            idx = select_kept(self._score(query, keys, vs, scaling, seen), held, target, head, tail)
            b, h = idx.shape[:2]
            dev = idx.device
            if self.demoted:  # the evicted rows, from the rows as attention read them, to the cheaper codec
                gone = torch.ones(b, h, held, dtype=torch.bool, device=dev)
                gone.scatter_(2, idx, False)
                gone_idx = gone.nonzero()[:, 2].view(b, h, held - idx.shape[2])
                for store, rows in zip(self.demoted, (keys, vs.dense(query.dtype))):
                    store.append(_take(rows, gone_idx.to(rows.device)))
            dropped = compact_store(ks, idx)
            compact_store(vs, idx)
            for buf in (self.positions, self.mass):
                if buf.data is not None:
                    data = _take(buf.view(), idx.to(buf.data.device))
                    buf.data, buf.n, buf.start = None, 0, 0
                    buf.append(data)
            if t > 1:
                self.evicted_prefill += dropped
            else:
                self.evicted_decode += dropped
        if not self.every:  # no later eviction point reads these queries
            self.queries = None
        ks.release()
        vs.release()

    def _evict_ragged(self, layer, query, scaling, seen: int, t: int, keys, target: int | None) -> None:
        """A ragged layer: with heads=ada the layer keeps ``heads * target`` rows, shared between its heads by
        ``select_ada``; with a per-head keep list each head keeps its own ``kept_rows``, its best-scored."""
        ks, vs = layer.k_store, layer.v_store
        held = ks.rows
        if self.shared is not None:  # budget=global: each head's count chosen over every layer and head
            targets = self.shared.targets(self, seen, t)
            if all(n <= m for n, m in zip(held, targets)):
                return
        elif self.head_keep is None:
            if sum(held) <= len(held) * target:
                return
        else:
            targets = [kept_rows(seen, k, self.sink, self.window, self.recent) for k in self.head_keep]
            if all(n <= m for n, m in zip(held, targets)):
                return
        head, tail = protected_rows(seen, self.sink, self.window, self.recent)
        if keys is None:
            keys = ks.dense(query.dtype)
        score = self._score(query, keys, vs, scaling, seen)
        if self.head_keep is None and self.shared is None:
            # (with demote every head demotes a row: each head's demote store holds its codec state, as counted)
            # (rows move only between heads whose codecs cost the same per row: the bytes stay the estimate's)
            groups = cost_groups(ks, vs, keys.shape[-1], layer.v_dim)
            idx = select_ada(score, held, target, head, tail, self.ada_floor, drop_one=self.demoted is not None,
                             groups=groups)
        else:
            b, dev = score.shape[0], score.device
            idx = [select_kept(score[:, h : h + 1, :n], n, m, head, tail) if m < n
                   else torch.arange(n, device=dev).expand(b, 1, n) for h, (n, m) in enumerate(zip(held, targets))]
        if self.demoted:  # each head's evicted rows, as attention read them, to its own demote store
            for store, rows in zip(self.demoted, (keys, vs.dense(query.dtype))):
                store.append_heads([_take(rows[:, h : h + 1, :n], _gone(i, n).to(rows.device))
                                    for h, (i, n) in enumerate(zip(idx, held))])
        dropped = ks.compact(idx) // len(held)  # the mean over the heads
        vs.compact(idx)
        for buf in (self.positions, self.mass):
            if isinstance(buf, HeadRows):
                buf.take(idx)
        if t > 1:
            self.evicted_prefill += dropped
        else:
            self.evicted_decode += dropped

    def _score(self, query, keys, v_store, scaling, seen) -> torch.Tensor:
        """[B, H, held] scores (ragged: padding scored -inf, and masked out of every softmax by its position)."""
        x = scores.ScoreInput(query, keys, lambda: v_store.dense(query.dtype), scaling, seen, self.held_positions(),
                              self.ragged, self.queries, self.mass.view() if self.ranker.accumulates else None,
                              self.rows)
        s = self.ranker(x)
        if self.ragged:
            s = s.float().masked_fill(self.held_positions() == PAD_POSITION, float("-inf"))
        return s

    # -- budget=global (``global_budget``) ------------------------------------------------------------------
    def positions_after(self, seen: int, t: int) -> torch.Tensor:
        """``[B, H, T]`` the positions each KV head holds once the call of ``t`` rows ending at ``seen`` is appended
        (padded with ``PAD_POSITION``): the held ones, plus the call's when this layer has not appended it yet."""
        if isinstance(self.positions, HeadRows):
            heads = self.positions.heads()
        elif self.positions.data is not None:
            v = self.positions.view()
            heads = [v[:, h : h + 1] for h in range(v.shape[1])]
        else:
            heads = []
        if not heads or heads[0].shape[2] == 0 or int(heads[0][0, 0, -1]) < seen - t:
            b = self.rows.shape[0] if self.rows is not None else (heads[0].shape[0] if heads else 1)
            n = len(heads) or self.kv_heads or (self.rows.shape[1] if self.rows is not None else 1)
            dev = heads[0].device if heads else (self.rows.device if self.rows is not None else None)
            new = torch.arange(seen - t, seen, dtype=POSITION_DTYPE, device=dev).view(1, 1, t).expand(b, 1, t)
            heads = [torch.cat([x, new], dim=2) for x in heads] if heads else [new] * n
        return pad_rows(heads, PAD_POSITION)

    @staticmethod
    def held_counts(positions: torch.Tensor) -> list[int]:
        """Rows each KV head holds in a padded ``[B, H, T]`` positions tensor (sequence 0)."""
        return (positions[0] != PAD_POSITION).sum(-1).tolist()

    def rank_positions(self, positions: torch.Tensor, seen: int) -> torch.Tensor:
        """``[B, H, T]`` this layer's ranking of the rows at ``positions`` (a context-pass score reads no query or
        key: ``keep.CONTEXT_PASS_SCORES``); padding -inf."""
        x = scores.ScoreInput(None, None, None, 0.0, seen, positions, True, None, None, self.rows)
        return self.ranker(x).float().masked_fill(positions == PAD_POSITION, float("-inf"))

    # -- batch ----------------------------------------------------------------------------------
    def map_batch(self, fn) -> None:
        for buf in (self.positions, self.mass):
            if isinstance(buf, HeadRows):
                buf.map(fn)
            elif buf.data is not None:
                buf.data = fn(buf.data)
        if self.queries is not None:
            self.queries = fn(self.queries)
        if self.rows is not None:
            self.rows = fn(self.rows)
        if self.demoted:
            raise EvictionError("demote= does not follow a batch reordered or repeated (beam search): decode "
                                "without beams, or drop the evicted rows (no demote)")
