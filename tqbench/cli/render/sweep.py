"""The sweep report as rich tables and Markdown: one table per model (policies ranked by bits, with quality),
the recommendation rule's answer per model, and the failed cells. Front-end code, not engine."""

from __future__ import annotations

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
    ("speed ratio", "throughput_ratio", ".2f"), ("frontier", "frontier", None), ("failed", "failed_cells", "d"),
)


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


def _headers(m: dict) -> list[str]:
    n = next((r["est_tokens"] for r in m["rows"] if r.get("est_tokens")), None)
    return [h.replace("@N", f"@{n}" if n else "est") for h, _, _ in COLUMNS]


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
                        f"({report.cache_mode})")
        for header, (_, key, _) in zip(_headers(m), COLUMNS):
            t.add_column(header, justify="left" if key in ("policy", "verdict") else "right",
                         overflow="fold" if key in ("policy", "verdict") else "ellipsis")
        for r in m["rows"]:
            t.add_row(*(_cell(r, key, fmt, True) for _, key, fmt in COLUMNS))
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
        lines += [f"## {m['model_name'] or m['model']}", "",
                  "| " + " | ".join(_headers(m)) + " |",
                  "| " + " | ".join("---" if k in ("policy", "verdict") else "---:" for _, k, _ in COLUMNS) + " |"]
        for r in m["rows"]:
            lines.append("| " + " | ".join(_cell(r, key, fmt, False) for _, key, fmt in COLUMNS) + " |")
        lines += ["", f"- {rec_line(m, report.baseline)}", ""]
    if report.failed:
        lines += ["## Failed cells", ""] + [f"- `{c['cell_id']}`: {c['error']['type']}: {c['error']['message']}"
                                            for c in report.failed] + [""]
    return "\n".join(lines)
