"""The task suite's table and Markdown report (``engine.tasks.TasksResult``). Front-end code, not engine."""

from __future__ import annotations

from rich.table import Table

from tqbench.cli.render.console import out

COLUMNS = ("task", "protocol", "samples", "chance", "baseline", "candidate", "agreement", "delta")


def _score(r: dict, side: str) -> str:
    lo, hi = r[f"{side}_ci"]
    return f"{r[f'{side}_score']:.1f} [{lo:.0f}-{hi:.0f}]"


def _cells(r: dict) -> list[str]:
    return [r["task"], r["protocol"], str(r["samples"]), f"{r['chance']:.0f}", _score(r, "baseline"),
            _score(r, "candidate"), f"{r['agreement']:.0f}%", f"{r['delta']:+.1f}"]


def _rows(res) -> list[list[dict]]:
    """Per protocol: its task rows, then its overall row."""
    return [[*(res.task_row(x, p) for x in res.tasks), res.task_row(None, p)] for p in res.protocols]


def _title(res) -> str:
    cr = {row["method"]: row["compression_ratio"] for row in res.leaderboard() if row["task"] == "overall"}
    cached = f", baseline answers cached for {res.baseline_cached}" if res.baseline_cached else ""
    return (f"{res.dataset}: {res.candidate} (compression ratio {cr.get(res.candidate, 0):.3f}) vs {res.baseline}, "
            f"{res.model}, {res.cache_mode}, scores in points [95% interval]{cached}")


def print_tasks(res) -> None:
    t = Table(title=_title(res))
    for col in COLUMNS:
        t.add_column(col, justify="left" if col == "task" else "right")
    for block in _rows(res):
        for r in block[:-1]:
            t.add_row(*_cells(r))
        t.add_section()
        t.add_row(*_cells(block[-1]))
        t.add_section()
    out.print(t)


def tasks_md(res) -> str:
    lines = [f"# {_title(res)}", "", "| " + " | ".join(COLUMNS) + " |", "| --- |" + " ---: |" * (len(COLUMNS) - 1)]
    for r in [r for block in _rows(res) for r in block]:
        lines.append("| " + " | ".join(_cells(r)) + " |")
    return "\n".join(lines) + "\n"
