"""Head budgets: how many rows each KV head of a layer keeps at an eviction point, and which, over the ranking of
any score (``scores``). One class per budget, chosen by the policy (``head_budget``); the ``Evictor`` scores, asks
its budget for the rows to keep, then compacts (and demotes: ``demote.DemoteTier``) whatever the budget.

- ``Uniform``: every KV head keeps ``kept_rows`` (``heads=uniform``, the default).
- ``Ada``: AdaKV (``heads=ada``): the layer keeps ``heads * kept_rows``, shared between its heads by their scores
  (``ragged.select_ada``), rows moving only between heads whose rows cost the same.
- ``HeadList``: one keep fraction per KV head (``keep=0.5|1|0.25``).
- ``Global``: ``budget=global``: each head's count chosen over every layer and head (``global_budget``).

Every budget keeps each head's sinks and its last ``max(window, recent)`` rows (``protected_rows``) and, of the
rows between them, the best-scored. ``select`` returns the sorted ordinals to keep: ``[B, H, n]`` for a uniform
layer, one ``[B, 1, n_h]`` per KV head for a ragged one; None when nothing is evicted."""

from __future__ import annotations

import torch

from tqbench.engine.cache.evict.ragged import cost_groups, select_ada
from tqbench.engine.policy.keep import head_keeps, kept_rows

__all__ = ["Ada", "Global", "HeadBudget", "HeadList", "Uniform", "head_budget", "select_kept"]


def select_kept(score: torch.Tensor, held: int, target: int, head: int, tail: int) -> torch.Tensor:
    """Ordinals [B, H, target] (sorted) of the rows each KV head keeps out of ``held``: the first ``head`` and the
    last ``tail`` always, the best-scored (``score`` [B, H, held], higher: keep) of the rows between them."""
    sel = score[..., head : held - tail].topk(target - head - tail, dim=-1).indices.sort(dim=-1).values + head
    b, h = sel.shape[:2]
    dev = sel.device
    return torch.cat([torch.arange(head, device=dev).expand(b, h, head), sel,
                      torch.arange(held - tail, held, device=dev).expand(b, h, tail)], dim=2)


def _per_head(score: torch.Tensor, held: list[int], targets: list[int], head: int, tail: int) -> list:
    """Each head ``h`` keeps its best ``targets[h]`` of its ``held[h]`` rows (all of them when it holds no more)."""
    b, dev = score.shape[0], score.device
    return [select_kept(score[:, h : h + 1, :n], n, m, head, tail) if m < n
            else torch.arange(n, device=dev).expand(b, 1, n) for h, (n, m) in enumerate(zip(held, targets))]


class HeadBudget:
    """How the rows a layer keeps are shared between its KV heads. ``ragged``: each head holds its own count (one
    store per KV head, ``ragged.RaggedStore``)."""

    ragged = True

    def __init__(self, ev) -> None:
        self.ev = ev  # the layer's Evictor (its keep, sinks, window, recent)

    def target(self, seen: int) -> int:
        ev = self.ev
        return kept_rows(seen, ev.keep, ev.sink, ev.window, ev.recent)

    def targets(self, held, seen: int, t: int) -> list[int] | None:  # pragma: no cover - abstract
        """Rows each KV head keeps (None: the budget shares a layer total: ``Ada``)."""
        raise NotImplementedError

    def evicts(self, held, seen: int, t: int) -> bool:
        """Whether this point drops any row (``held``: a head's rows, or each head's)."""
        return any(n > m for n, m in zip(held, self.targets(held, seen, t)))

    def select(self, score, held, seen: int, t: int, head: int, tail: int, layer, k_dim: int,
               drop_one: bool):
        return _per_head(score, held, self.targets(held, seen, t), head, tail)


class Uniform(HeadBudget):
    ragged = False

    def evicts(self, held: int, seen: int, t: int) -> bool:
        return self.target(seen) < held

    def select(self, score, held: int, seen: int, t: int, head: int, tail: int, layer, k_dim: int,
               drop_one: bool):
        return select_kept(score, held, self.target(seen), head, tail)


class Ada(HeadBudget):
    def evicts(self, held: list[int], seen: int, t: int) -> bool:
        return sum(held) > len(held) * self.target(seen)

    def select(self, score, held, seen: int, t: int, head: int, tail: int, layer, k_dim: int,
               drop_one: bool):
        # (with demote every head demotes a row: each head's demote store holds its codec state, as counted)
        # (rows move only between heads whose codecs cost the same per row: the bytes stay the estimate's)
        groups = cost_groups(layer.k_store, layer.v_store, k_dim, layer.v_dim)
        return select_ada(score, held, self.target(seen), head, tail, self.ev.ada_floor, drop_one=drop_one,
                          groups=groups)


class HeadList(HeadBudget):
    def targets(self, held, seen: int, t: int) -> list[int]:
        ev = self.ev
        keeps = head_keeps(ev.keep, len(held), ev.layer_index)
        return [kept_rows(seen, k, ev.sink, ev.window, ev.recent) for k in keeps]


class Global(HeadBudget):
    def targets(self, held, seen: int, t: int) -> list[int]:
        return self.ev.shared.targets(self.ev, seen, t)


def head_budget(ev, policy, plan) -> HeadBudget:
    """The budget of a layer's ``Evictor`` under ``policy``."""
    if policy.budget == "global":
        return Global(ev)
    if plan.head_keeps:
        return HeadList(ev)
    if policy.heads == "ada":
        return Ada(ev)
    return Uniform(ev)
