"""The task suite's table and Markdown report (``engine.tasks.TasksResult``). Front-end code, not engine."""

from __future__ import annotations

from rich.table import Table

from tqbench.cli.render.console import out

COLUMNS = ("task", "samples", "chance", "baseline", "candidate", "agreement", "delta")


def _cells(r: dict) -> list[str]:
    return [r["task"], str(r["samples"]), f"{r['chance']:.0f}", f"{r['baseline_score']:.1f}",
            f"{r['candidate_score']:.1f}", f"{r['agreement']:.0f}%", f"{r['delta']:+.1f}"]


def _title(res) -> str:
    cr = {row["method"]: row["compression_ratio"] for row in res.leaderboard() if row["task"] == "overall"}
    cached = f", baseline answers cached for {res.baseline_cached}" if res.baseline_cached else ""
    return (f"{res.dataset}: {res.candidate} (compression ratio {cr.get(res.candidate, 0):.3f}) vs {res.baseline}, "
            f"{res.model}, {res.cache_mode}, scores in points{cached}")


def print_tasks(res) -> None:
    t = Table(title=_title(res))
    for col in COLUMNS:
        t.add_column(col, justify="left" if col == "task" else "right")
    rows = [res.task_row(x) for x in res.tasks]
    for r in rows:
        t.add_row(*_cells(r))
    t.add_section()
    t.add_row(*_cells(res.task_row(None)))
    out.print(t)


def tasks_md(res) -> str:
    lines = [f"# {_title(res)}", "", "| " + " | ".join(COLUMNS) + " |", "| --- |" + " ---: |" * (len(COLUMNS) - 1)]
    for r in [*(res.task_row(x) for x in res.tasks), res.task_row(None)]:
        lines.append("| " + " | ".join(_cells(r)) + " |")
    return "\n".join(lines) + "\n"
