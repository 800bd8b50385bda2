"""Rich tables and Markdown reports of the many-policy commands: ``compare-policies`` (``CompareResult``)
and ``niah`` (``NiahResult``). Front-end code, not engine."""

from __future__ import annotations

from rich.table import Table

from tqbench.cli.render.console import out
from tqbench.cli.render.formats import EVIDENCE_HINT, num, pct, verdict_markup


# ---- compare-policies -----------------------------------------------------------------------------------
def _rec_lines(rec: dict) -> list[str]:
    lines = []
    caveat = rec.get("caveat")
    if rec["status"] == "compressed-policy":
        word = "recommended on too little evidence" if caveat else "recommended"
        lines.append(f"{word}: {rec['recommended_policy']} ({rec['memory_saved_pct']:.1f}% saved, exact-match "
                     "on every prompt)")
    else:
        lines.append(f"recommended: keep {rec['recommended_policy']} (no compressed policy was exact-match and "
                     f"saves memory); best risky policy: {rec['best_risky_policy']}")
    lines.append("unsafe (diverged): " + (", ".join(rec["unsafe_policies"]) or "none"))
    for s in rec.get("saves_nothing_policies") or ():
        lines.append(f"saves nothing: {s['policy']}: {s['note']}")
    if caveat:
        lines.append(f"caveat: {caveat} ({EVIDENCE_HINT['compare']})")
    if rec.get("note"):
        lines.append(rec["note"])
    return lines


def _div(row) -> str:
    """First divergence index per prompt ('-' = identical); ``row``: engine.validate.CompareRow."""
    return " / ".join("-" if x is None else str(x) for x in row.first_divergence_indices)


def print_compare(res, summary_only: bool = False) -> None:
    """``res``: engine.validate.CompareResult (``rows``: ``CompareRow``; ``recommendation``: the rule's dict)."""
    if not summary_only:
        t = Table(title=f"compare-policies vs {res.baseline} ({res.cache_mode}, {len(res.prompts)} prompts, "
                  f"{res.max_new_tokens} new tokens)")
        for col in ("policy", "saved", "bits/el", "verdict", "first div", "token match", "top-1", "KL mean",
                    "tput ratio"):
            t.add_column(col, justify="left" if col in ("policy", "verdict") else "right")
        for r in res.rows:
            t.add_row(r.policy, pct(r.memory_saved_pct), num(r.bits_per_element, ".2f"),
                      verdict_markup(r.verdict), _div(r),
                      num(r.token_match_ratio, ".3f"), num(r.top1_match_ratio, ".3f"), num(r.kl_mean, ".5f"),
                      num(r.throughput_ratio, ".2f"))
        out.print(t)
    for line in _rec_lines(res.recommendation):
        out.print(line, markup=False, highlight=False)


def compare_md(res) -> str:
    lines = [f"# compare-policies vs {res.baseline} ({res.model}, {res.cache_mode}, {len(res.prompts)} prompts, "
             f"{res.max_new_tokens} new tokens)", "",
             "| policy | saved | bits/element | verdict | first divergence | token match | top-1 | KL mean | "
             "throughput ratio |",
             "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in res.rows:
        lines.append(f"| {r.policy} | {pct(r.memory_saved_pct)} | {num(r.bits_per_element, '.2f')} | "
                     f"{r.verdict} | {_div(r)} | {num(r.token_match_ratio, '.3f')} | "
                     f"{num(r.top1_match_ratio, '.3f')} | "
                     f"{num(r.kl_mean, '.5f')} | {num(r.throughput_ratio, '.2f')} |")
    lines += [""] + [f"- {x}" for x in _rec_lines(res.recommendation)]
    return "\n".join(lines) + "\n"


# ---- niah ---------------------------------------------------------------------------------------------
def print_niah(res) -> None:
    """``res``: engine.validate.niah.NiahResult."""
    for pol in [res.baseline, *res.policies]:
        t = Table(title=f"needle in a haystack: {pol} ({res.cache_mode})")
        t.add_column("length \\ depth", justify="right")
        for d in res.depths:
            t.add_column(f"{d:g}", justify="center")
        for n, row in zip(res.lengths, res.recall(pol)):
            t.add_row(str(n), *("[green]yes[/]" if x else "[red]no[/]" for x in row))
        out.print(t)
    t = Table(title="recall summary")
    for col in ("policy", "recall", "mean score", "agrees with baseline"):
        t.add_column(col)
    for r in res.summary():
        t.add_row(r["policy"], f"{r['recall']:.2f}", f"{r['mean_score']:.2f}", f"{r['agreement_with_baseline']:.2f}")
    out.print(t)


def niah_md(res) -> str:
    lines = [f"# Needle in a haystack ({res.model}, {res.cache_mode})", ""]
    for pol in [res.baseline, *res.policies]:
        lines += [f"## {pol}", "", "| length \\ depth | " + " | ".join(f"{d:g}" for d in res.depths) + " |",
                  "| ---: |" + " :---: |" * len(res.depths)]
        for n, row in zip(res.lengths, res.recall(pol)):
            lines.append(f"| {n} | " + " | ".join("yes" if x else "no" for x in row) + " |")
        lines.append("")
    lines += ["| policy | recall | mean score | agreement with baseline |", "| --- | ---: | ---: | ---: |"]
    lines += [f"| {r['policy']} | {r['recall']:.2f} | {r['mean_score']:.2f} | {r['agreement_with_baseline']:.2f} |"
              for r in res.summary()]
    return "\n".join(lines) + "\n"
