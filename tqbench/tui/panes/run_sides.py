"""The Run tab's two sides by name: the baseline (a dense ``DynamicCache`` with its K/V dtype, or a policy) and the
candidate (its policy and cache mode) titled on the token views and named on the throughput graph, for a live run
and for a saved one (``RunSides``, a part of ``RunPane``)."""

from __future__ import annotations

from tqbench.constants import DENSE_BASELINES, dense_baseline_kv
from tqbench.tui.widgets.graph import ThroughputGraph
from tqbench.tui.widgets.token_view import TokenView


def base_title(baseline: str, model_dtype: str | None) -> str:
    """``dense-fp16 (float16 K/V)`` for a dense baseline, ``fp16 (compressed)`` for a policy."""
    from tqbench.engine.policy import parse_policy

    if baseline in DENSE_BASELINES:
        kv = dense_baseline_kv(baseline, model_dtype) if model_dtype else DENSE_BASELINES[baseline]
        return f"{baseline} ({kv or 'model dtype'} K/V)"
    return f"{parse_policy(baseline).label} (compressed)"


def cand_title(label: str, mode: str) -> str:
    title = f"candidate · {label} ({mode})"
    if mode == "dense-shadow":
        title += " · storage-only: reads exact K/V"
    return title


class RunSides:
    """Titles and graph names of the two sides (the views and graph ``RunPane.compose`` yields)."""

    def _name_sides(self, engine, params) -> None:
        """A run starting with ``params`` (``RunParams``): empty views and graph, titled with its sides."""
        from tqbench.engine.policy import parse_policy

        cand = parse_policy(params.candidate)
        base = base_title(params.baseline, str(engine.loaded.dtype).replace("torch.", ""))
        self.query_one("#baseline-view", TokenView).clear(f"baseline · {base}")
        self.query_one("#candidate-view", TokenView).clear(cand_title(cand.label, params.cache_mode))
        graph = self.query_one("#graph", ThroughputGraph)
        graph.clear()
        graph.set_names(base, f"{cand.label} ({params.cache_mode})")

    def _show_saved_sides(self, rec) -> None:
        """A saved ``RunRecord``: each side's tokens (those that differ marked), titles, speed and bytes."""
        views = {"baseline": self.query_one("#baseline-view", TokenView),
                 "candidate": self.query_one("#candidate-view", TokenView)}
        graph = self.query_one("#graph", ThroughputGraph)
        for run in ("baseline", "candidate"):
            side = getattr(rec, run)
            if side is None:
                views[run].clear(f"{run} · (none in this run)")
                continue
            texts = side.token_texts if side.has_token_texts else [f"[{i}]" for i in side.token_ids]
            views[run].set_tokens([(tid, text, rec.baseline is not None and i < rec.steps and not rec.same_token[i])
                                   for i, (tid, text) in enumerate(zip(side.token_ids, texts))])
        base = None
        if rec.baseline is not None:
            base = base_title(rec.baseline.policy, None) if rec.baseline.policy in DENSE_BASELINES \
                else f"{rec.baseline.policy} ({rec.baseline.cache_mode})"
        views["baseline"].border_title = f"baseline · {base or 'none'}"
        views["candidate"].border_title = cand_title(rec.candidate.policy, rec.candidate.cache_mode)
        graph.set_names(base or "", f"{rec.candidate.policy} ({rec.candidate.cache_mode})")
        graph.set_series(
            {r: getattr(rec, r).tokens_per_second for r in ("baseline", "candidate") if getattr(rec, r)},
            {r: getattr(rec, r).resident_bytes for r in ("baseline", "candidate") if getattr(rec, r)},
        )
