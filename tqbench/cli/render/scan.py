"""Rich table and Markdown report of ``scan`` (``ScanResult``). Front-end code, not engine."""

from __future__ import annotations

from rich.table import Table

from tqbench.cli.render.console import out
from tqbench.cli.render.formats import num


def _limits(thresholds: dict) -> str:
    return ", ".join(f"{k}<={v}" if k != "score_cosine" else f"{k}>={v}" for k, v in thresholds.items())


def print_scan(res, summary_only: bool = False) -> None:
    """``res``: engine.scan.ScanResult (``capture``, ``metrics``, ``norms``, ``verdicts`` are dicts)."""
    cap = res.capture
    t = Table(title=f"scan: {cap['model']}, {cap['tokens']} tokens, {len(res.layers)} layers x {res.kv_heads} KV "
              f"heads ({round(res.seconds, 3):.1f} s); thresholds " + _limits(res.thresholds))
    t.add_column("layer", justify="right")
    t.add_column("K norm", justify="right")
    t.add_column("V norm", justify="right")
    t.add_column("K outliers", justify="right")
    if not summary_only:
        for c in res.codecs:
            t.add_column(f"{c} KL", justify="right")
    t.add_column("cheapest")
    for i, v in enumerate(res.verdicts):
        kn = max(res.norms["k_norm"][i])
        vn = max(res.norms["v_norm"][i])
        ko = sum(len(x) for x in res.norms["k_outlier_channels"][i])
        cells = [str(v["layer"]), f"{kn:.1f}", f"{vn:.2f}", str(ko)]
        if not summary_only:
            cells += [num(max(res.metrics["softmax_kl"][c][i]), ".4f") for c in res.codecs]
        cells.append(v["cheapest"] or "[red]none (sensitive)[/]")
        t.add_row(*cells)
    out.print(t)
    out.print(f"codec meeting the thresholds on every layer: {res.cheapest['all_layers'] or 'none'}", markup=False)
    out.print(f"suggested policy: {res.suggest_policy()}", markup=False, highlight=False)


def scan_md(res) -> str:
    cap = res.capture
    lines = [f"# KV scan: {cap['model']} ({cap['tokens']} tokens, {len(res.layers)} layers x {res.kv_heads} KV heads)",
             "", "Worst-head softmax KL per layer and codec; thresholds: "
             + ", ".join(f"{k}={v}" for k, v in res.thresholds.items()), "",
             "| layer | " + " | ".join(res.codecs) + " | cheapest |",
             "| ---: |" + " ---: |" * len(res.codecs) + " --- |"]
    for i, v in enumerate(res.verdicts):
        lines.append(f"| {v['layer']} | " + " | ".join(f"{max(res.metrics['softmax_kl'][c][i]):.4f}"
                                                      for c in res.codecs) + f" | {v['cheapest'] or 'none'} |")
    lines += ["", f"Suggested policy: `{res.suggest_policy()}`", ""]
    return "\n".join(lines)
