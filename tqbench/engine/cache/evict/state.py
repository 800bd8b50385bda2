"""``Evictor``: one compressed layer's token eviction (``policy.keep``).

Eviction points: the end of every call of more than one row (a prefill, or a prefill chunk), and with
``every`` > 0 every ``every`` decoded tokens after the last prefill call. At a point the layer's stores defer
packing (``KVStore.defer``): the call's rows are scored and cut while still exact, after the call's attention
(the scores read its queries, in tqbench's attention function), then the stores pack as usual. Three objects,
each over the others' choices: the ranking (``scores``: any score, ``chunk=N`` wrapped), the head budget
(``budgets``: how many rows each KV head keeps, ``kept_rows`` per head or shared by AdaKV, a per-head list or
``budget=global``) and the demote tier (``demote``: where the evicted rows go). Sinks and the last max(window,
recent) rows are always kept; kept rows keep their positions (cached keys carry their rotary phase; nothing is
re-rotated).
"""

from __future__ import annotations

import torch

from tqbench.engine.cache.buffer import GrowBuffer
from tqbench.engine.cache.evict import scores
from tqbench.engine.cache.evict.bookkeeping import MASS_DTYPE, POSITION_DTYPE
from tqbench.engine.cache.evict.budgets import head_budget, select_kept
from tqbench.engine.cache.evict.compact import EvictionError, _take, compact_store
from tqbench.engine.cache.evict.demote import DemoteTier
from tqbench.engine.cache.evict.ragged import PAD_POSITION, HeadRows, pad_rows
from tqbench.engine.policy.keep import head_keeps, protected_rows

__all__ = ["EVICT_NO_CROP", "EvictionError", "Evictor", "select_kept"]

#: why a layer that evicts tokens cannot be cropped (speculative decoding's rejected drafts)
EVICT_NO_CROP = ("speculative decoding cannot run with token eviction (keep): a crop after a rejected draft must "
                 "restore the rows an eviction dropped, and they are gone; decode without speculation, or use a "
                 "policy without keep")



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
        #: how the kept rows are shared between the KV heads (``budgets``: uniform, ada, a per-head list, global)
        self.budget = head_budget(self, policy, plan)
        #: demote: the evicted rows kept at the layer's cheaper codec (``plan.demote``: ``policy.demote`` or a
        #: ``demote@`` override; ``demote.DemoteTier``), else None; ``demoted``: its K and V stores
        self.tier = DemoteTier(plan, policy, self.ragged) if plan.demote else None
        self.demoted = self.tier.stores if self.tier is not None else None

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
        return self.tier.rows if self.tier is not None else 0

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
        return self.tier.dense(role, dtype) if self.tier is not None else None

    def demoted_heads(self, role: str, dtype, heads: int) -> list:
        """A ragged layer's demoted rows per KV head (``[B, 1, n_h, D]`` or None), dequantized."""
        return self.tier.heads(role, dtype, heads) if self.tier is not None else [None] * heads

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
        """Score the held rows, keep what the head budget selects (the rest to the demote tier, or dropped)."""
        ks, vs = layer.k_store, layer.v_store
        held = ks.rows if self.ragged else ks.n_tokens
        self.points += 1
        if self.budget.evicts(held, seen, t):
            head, tail = protected_rows(seen, self.sink, self.window, self.recent)
            if keys is None:
                keys = ks.dense(query.dtype)
            score = self._score(query, keys, vs, scaling, seen)
            idx = self.budget.select(score, held, seen, t, head, tail, layer, keys.shape[-1],
                                     drop_one=self.tier is not None)
            if self.tier is not None:  # the evicted rows, as attention read them, to the cheaper codec
                self.tier.take(keys, vs.dense(query.dtype), idx, held)
            if self.ragged:
                dropped = ks.compact(idx) // len(held)  # the mean over the heads
                vs.compact(idx)
                for buf in (self.positions, self.mass):
                    if isinstance(buf, HeadRows):
                        buf.take(idx)
            else:
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
