"""The sweep report as rich tables and Markdown: one table per model (policies ranked by bits, with quality),
the recommendation rule's answer per model, and the failed cells. Front-end code, not engine."""

from __future__ import annotations

from rich import box
from rich.table import Table

from tqbench.cli.render.console import out
from tqbench.cli.render.formats import num, pct, verdict_markup

#: (header, row key, format)
COLUMNS = (
    ("rank", "rank", "d"), ("policy", "policy", None), ("bits/el @N", "est_bits_per_element", ".2f"),
    ("bits/el run", "bits_per_element", ".2f"),
    ("saved", "memory_saved_pct", "pct"), ("verdict", "verdict", None), ("token match", "token_match_ratio", ".3f"),
    ("KL (greedy)", "kl_mean", ".5f"), ("TF KL", "tf_kl_mean", ".5f"), ("TF top-1", "tf_top1_agreement", ".3f"),
    ("TF ppl ratio", "tf_ppl_ratio", ".4f"), ("NIAH recall", "niah_recall", ".2f"),
    ("tasks score", "tasks_score", ".1f"), ("tasks delta", "tasks_delta", "+.1f"),
    ("tasks compression", "tasks_compression_ratio", ".3f"),
    ("speed ratio", "throughput_ratio", ".2f"), ("frontier", "frontier", None), ("failed", "failed_cells", "d"),
)

#: measured at the short test texts' lengths: in the JSON and Markdown reports, left out of the terminal table
TERMINAL_SKIP = ("bits_per_element", "memory_saved_pct")


def _cell(row: dict, key: str, fmt: str | None, markup: bool) -> str:
    v = row.get(key)
    if key == "verdict":
        return "-" if v is None else (verdict_markup(v) if markup else v)
    if key == "frontier":
        return "-" if v is None else ("yes" if v else "")
    if fmt == "pct":
        return pct(v)
    if fmt is None:
        return "-" if v is None else str(v)
    return num(v, fmt)


def _columns(m: dict) -> list[tuple[str, str, str | None]]:
    """The columns that carry something for this model (a sweep without NIAH shows no NIAH column), with
    the estimate's context length in its header."""
    n = next((r["est_tokens"] for r in m["rows"] if r.get("est_tokens")), None)
    cols = []
    for h, key, fmt in COLUMNS:
        vals = [r.get(key) for r in m["rows"]]
        if key not in ("rank", "policy", "verdict") and all(v is None or (key == "failed_cells" and v == 0)
                                                            for v in vals):
            continue
        cols.append((h.replace("@N", f"@{n}" if n else "est"), key, fmt))
    return cols


def rec_line(m: dict, baseline: str) -> str:
    rec = m["recommendation"]
    if rec["status"] == "compressed-policy":
        s = f"recommended: {rec['recommended_policy']} ({rec['memory_saved_pct']:.1f}% saved, exact-match on every prompt)"
    elif rec["status"] == "keep-baseline":
        s = f"recommended: keep {baseline} (no compressed policy was exact-match); best risky: {rec['best_risky_policy']}"
    else:
        s = f"no recommendation: {rec.get('note')}"
    if rec.get("failed_policies"):
        s += f"; left out (failed cells): {', '.join(rec['failed_policies'])}"
    if rec.get("note") and rec["status"] != "no-verdicts":
        s += f" ({rec['note']})"
    return s


def print_sweep(report, where: str) -> None:
    for m in report.models:
        t = Table(title=f"sweep {report.name}: {m['model_name'] or m['model']} vs {report.baseline} "
                        f"({report.cache_mode})", box=box.SIMPLE_HEAD, padding=(0, 1))
        cols = [c for c in _columns(m) if c[1] not in TERMINAL_SKIP]
        for header, key, fmt in cols:
            header = header.replace(" ", "\n", 1) if key not in ("policy", "verdict") else header
            wide = max([len(_cell(r, key, fmt, False)) for r in m["rows"]] + [len(x) for x in header.split("\n")])
            t.add_column(header, justify="left" if key in ("policy", "verdict") else "right", no_wrap=True,
                         min_width=min(wide, 40))
        for r in m["rows"]:
            t.add_row(*(_cell(r, key, fmt, True) for _, key, fmt in cols))
        out.print(t)
        out.print(f"{m['model']}: {rec_line(m, report.baseline)}", markup=False, highlight=False)
    for c in report.failed:
        out.print(f"failed: {c['cell_id']}: {c['error']['type']}: {c['error']['message']}", markup=False,
                  highlight=False)
    if report.missing:
        out.print(f"missing (not run): {len(report.missing)} cells", markup=False)
    out.print(f"cells and report: {where}", markup=False, highlight=False)


def sweep_md(report, where: str) -> str:
    lines = [f"# Sweep {report.name} (vs {report.baseline}, {report.cache_mode})", "",
             f"Measurements: {', '.join(report.measure)}. Results: `{where}`. Rows ranked by bits per element "
             "(bits/el @N: exact estimate at the first `[bytes] tokens` length; bits/el run: what the runs' cache "
             "reports measured); frontier = no other policy has fewer-or-equal bits and lower-or-equal quality loss "
             "(teacher-forced KL, else greedy KL).", ""]
    for m in report.models:
        cols = _columns(m)
        lines += [f"## {m['model_name'] or m['model']}", "",
                  "| " + " | ".join(h for h, _, _ in cols) + " |",
                  "| " + " | ".join("---" if k in ("policy", "verdict") else "---:" for _, k, _ in cols) + " |"]
        for r in m["rows"]:
            lines.append("| " + " | ".join(_cell(r, key, fmt, False) for _, key, fmt in cols) + " |")
        lines += ["", f"- {rec_line(m, report.baseline)}", ""]
    overall = [r for r in report.leaderboard if r["task"] == "overall"]
    if overall:
        lines += ["## Task suite (overall, in points)", "", "| dataset | model | method | compression_ratio | score |",
                  "| --- | --- | --- | ---: | ---: |"]
        lines += [f"| {r['dataset']} | {r['model']} | {r['method']} | {r['compression_ratio']:.3f} | "
                  f"{r['score']:.1f} |" for r in overall] + [""]
    if report.failed:
        lines += ["## Failed cells", ""] + [f"- `{c['cell_id']}`: {c['error']['type']}: {c['error']['message']}"
                                            for c in report.failed] + [""]
    return "\n".join(lines)
