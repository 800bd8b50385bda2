"""A sweep directory opened as a session (``tqbench --session DIR``): the Compare tab shows every cell (one row
each: policy @ text [model]), sortable by any column, and enter opens a row in Run with that cell's prompt and
policy. The report is read from ``DIR/report.json``; a sweep that never finished shows the cells it wrote."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tqbench.engine.sweep import SweepReport


def is_sweep_dir(path) -> bool:
    """A sweep's --out folder (it holds ``sweep.json``); checked without importing the engine."""
    return Path(path).is_dir() and (Path(path) / "sweep.json").is_file()


def sweep_model(path) -> str:
    """The sweep's first model (the workbench loads it)."""
    from tqbench.engine.sweep import SweepDir

    models = SweepDir(path).read_spec()["spec"]["models"]
    return models[0]["spec"] if models else "default"


def read_report(path, partial: bool = False) -> tuple[SweepReport, str]:
    """(report, note): the final report, or (``partial``, or when the sweep did not finish) the cells found."""
    import json

    from tqbench.engine.sweep import SweepDir, SweepReport

    store = SweepDir(path)
    spec = store.read_spec()["spec"]
    report_file = Path(path) / "report.json"
    if report_file.is_file() and not partial:
        rep = SweepReport.from_dict(json.loads(report_file.read_text(encoding="utf-8")))
        return rep, f"sweep {rep.name}: {len(rep.cells)} cells"
    rep = SweepReport(spec["name"], spec["baseline"], spec["cache_mode"], spec["measure"],
                      max_new_tokens=spec["validate"]["max_new_tokens"], cells=store.all_cells())
    return rep, f"sweep {rep.name} did not finish (no report.json): {len(rep.cells)} cells written"


def open_sweep(app, path) -> bool:
    if app.busy:
        app.notify("work is going: press escape first, then open the sweep", severity="warning")
        return False
    try:
        report, note = read_report(path)
    except (OSError, ValueError, KeyError) as exc:
        app.notify(f"{path}: {exc}", title="cannot open sweep", severity="error", timeout=10)
        return False
    failed = len(report.failed)
    note += (f", {failed} failed" if failed else "") + " · enter opens a cell in Run"
    app.compare_pane.show_result(report.as_compare_result(), note=note)
    app.action_tab("compare")
    app.notify(f"opened sweep {Path(path).name}: {len(report.cells)} cells", title="sweep opened")
    return True
