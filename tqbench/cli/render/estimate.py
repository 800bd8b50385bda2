"""Rich tables and Markdown report of ``kv-estimate`` (``KVEstimateReport``, ``ModelGeometry``). Front-end
code, not engine."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text

from tqbench.cli.render.console import out
from tqbench.cli.render.formats import human_bytes, pct


def _sliding_layers(geo) -> int:
    """Sliding-window layers of a ``ModelGeometry``: the engine has no attribute for it yet, only the
    ``to_dict()`` field (one definition, there)."""
    return geo.to_dict()["sliding_layers"]


def print_kv_estimate(rep) -> None:
    """``rep``: engine.cache.estimate.KVEstimateReport (``rows``: ``KVEstimateRow``)."""
    m, g = rep.model, rep.model.geometry
    sliding = _sliding_layers(m)
    dims = f"head_dim {g.head_dim}" + (f" (V {g.v_dim})" if g.v_dim != g.head_dim else "")
    title = (f"kv-estimate: {m.name} ({g.num_layers} layers, {g.kv_heads} KV heads, {dims}"
             + (f", {sliding} sliding layers of {g.sliding_window}" if sliding else "")
             + f"), {rep.seq_len} tokens, batch {rep.batch}")
    t = Table(title=title)
    budget = rep.memory_budget_bytes
    cols = ["policy", "KV bytes", "KV size", "fp16 bytes", "bits/el", "saved"]
    if budget is not None:
        cols.append(f"max tokens in {human_bytes(budget)}")
    for col in cols:
        t.add_column(col, justify="left" if col == "policy" else "right")
    for r in rep.rows:
        cells = [r.kv_policy, str(r.total_bytes), human_bytes(r.total_bytes), str(r.dense_fp16_bytes),
                 f"{r.bits_per_element:.3f}", pct(r.saved_pct)]
        if budget is not None:
            cells.append(str(r.max_seq_len_in_budget) + (" (model max)" if r.capped_by_model_context else ""))
        t.add_row(*cells)
    out.print(t)
    for r in rep.rows:
        if r.note:
            out.print(f"note ({r.kv_policy}): {r.note}", markup=False)


def kv_estimate_md(rep) -> str:
    budget = rep.memory_budget_bytes is not None
    lines = [f"# KV estimate: {rep.model.name}, {rep.seq_len} tokens, batch {rep.batch}", "",
             "| policy | KV bytes | fp16 bytes | bits/element | saved |" + (" max tokens in budget |" if budget else ""),
             "| --- | ---: | ---: | ---: | ---: |" + (" ---: |" if budget else "")]
    for r in rep.rows:
        lines.append(f"| {r.kv_policy} | {r.total_bytes} | {r.dense_fp16_bytes} | {r.bits_per_element:.3f} "
                     f"| {pct(r.saved_pct)} |" + (f" {r.max_seq_len_in_budget} |" if budget else ""))
    return "\n".join(lines) + "\n"


CURVE_MARKERS = ("*", "+", "x", "o", "#", "=")


def print_kv_curve(reps: list) -> None:
    """Several ``KVEstimateReport``s of one geometry and policies at growing contexts: a table of bytes per policy
    and context, and a terminal chart (plotext) of bytes against context, one line per policy."""
    import plotext as plt

    m, g = reps[0].model, reps[0].model.geometry
    t = Table(title=f"kv-estimate: {m.name} ({g.num_layers} layers, {g.kv_heads} KV heads, head_dim {g.head_dim}), "
                    f"batch {reps[0].batch}: KV bytes by context")
    t.add_column("policy")
    for rep in reps:
        t.add_column(f"{rep.seq_len} tokens", justify="right")
    t.add_column("bits/el (last)", justify="right")
    for i, row in enumerate(reps[0].rows):
        t.add_row(row.kv_policy, *(human_bytes(rep.rows[i].total_bytes) for rep in reps),
                  f"{reps[-1].rows[i].bits_per_element:.3f}")
    out.print(t)
    fig = plt.figure
    fig.clear()
    fig.plot_size(min(out.width, 100), 20)
    xs = [rep.seq_len for rep in reps]
    keys = []
    for i, row in enumerate(reps[0].rows):
        ys = [rep.rows[i].total_bytes / 2**20 for rep in reps]
        mark = CURVE_MARKERS[i % len(CURVE_MARKERS)]
        for j in range(len(xs) - 1):
            fig.draw(fig.segment(xs[j : j + 2], ys[j : j + 2], marker=mark))
        keys.append(f"{mark} {row.kv_policy}")
    fig.title("KV cache MiB against context tokens")
    fig.legend(active=False)
    out.print(Text.from_ansi(fig.build().string()))
    out.print("   ".join(keys), markup=False, highlight=False)


def kv_curve_md(reps: list) -> str:
    lines = [f"# KV estimate: {reps[0].model.name}, batch {reps[0].batch}, bytes by context", "",
             "| policy | " + " | ".join(f"{rep.seq_len} tokens" for rep in reps) + " |",
             "| --- |" + " ---: |" * len(reps)]
    for i, row in enumerate(reps[0].rows):
        lines.append(f"| {row.kv_policy} | " + " | ".join(str(rep.rows[i].total_bytes) for rep in reps) + " |")
    return "\n".join(lines) + "\n"


def print_models(models: list) -> None:
    """``models``: engine.cache.geometry.ModelGeometry, one per shipped config."""
    t = Table(title="shipped model configs (kv-estimate --model NAME)")
    for col in ("name", "layers", "KV heads", "head_dim", "sliding", "max context"):
        t.add_column(col)
    for m in models:
        g, sliding = m.geometry, _sliding_layers(m)
        t.add_row(m.name, str(g.num_layers), str(g.kv_heads), str(g.head_dim),
                  f"{sliding} x {g.sliding_window}" if sliding else "-", str(m.max_context))
    out.print(t)
