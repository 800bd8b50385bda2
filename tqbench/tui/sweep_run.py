"""Run a sweep from the workbench (command palette: "Run sweep"): the cells stream into the Compare tab as they
finish (progress bar, status line, the table of cells so far); escape stops it after the running cell, and the
finished cells stay in the folder (``--resume`` or "resume" continues). The loaded model is reused for cells of
the same model spec; other models load in the worker."""

from __future__ import annotations

from textual.widgets import Label, ProgressBar

from tqbench.tui import sweep_flow


def ask(app) -> None:
    from tqbench.tui.screens.sweep import SweepScreen

    def chosen(answer) -> None:
        if answer is not None:
            start(app, answer["spec"], answer["out"], ray=answer["ray"], resume=answer["resume"])

    app.push_screen(SweepScreen(), chosen)


def start(app, spec_path: str, out: str | None = None, *, ray: bool = False, resume: bool = False) -> bool:
    from tqbench.engine.sweep import SpecError, expand, load_spec

    pane = app.compare_pane
    if app.busy:
        app.notify("work is going: press escape first, then start the sweep", severity="warning")
        return False
    try:
        spec = load_spec(spec_path)
    except SpecError as exc:
        app.notify(str(exc), title="cannot run the sweep", severity="error", timeout=10)
        return False
    out = out or f"sweeps/{spec.name}"
    engines = {app.model_spec: app.engine} if app.engine is not None else {}
    pane.running, pane.status = True, "running"
    pane._cancel.clear()
    pane.query_one("#cmp-bar", ProgressBar).update(total=len(expand(spec)), progress=0)
    pane.query_one("#cmp-status", Label).update(f"sweep {spec.name}: starting ({'Ray' if ray else 'in-process'})")
    app.action_tab("compare")

    def job() -> None:
        from tqbench.engine.events import Cancelled
        from tqbench.engine.sweep import run_sweep

        try:
            report = run_sweep(spec, out, resume=resume, ray=ray, engines=engines, cancel=pane._cancel.is_set,
                               on_event=lambda ev: app.call_from_thread(_event, app, ev, out))
        except Cancelled:
            app.call_from_thread(_ended, app, out, None, "cancelled")
        except Exception as exc:  # shown; the app keeps running
            app.call_from_thread(_ended, app, out, None, str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        else:
            app.call_from_thread(_ended, app, out, report, None)

    app.run_worker(job, thread=True, group="sweep", exclusive=True, exit_on_error=False)
    return True


def _event(app, ev, out: str) -> None:
    from tqbench.engine.events import Progress
    from tqbench.engine.sweep import SweepCellFinished

    pane = app.compare_pane
    if isinstance(ev, Progress) and ev.task == "sweep":
        pane.query_one("#cmp-bar", ProgressBar).update(total=ev.total, progress=ev.done)
        pane.query_one("#cmp-status", Label).update(f"sweep: {ev.done}/{ev.total} cells · {ev.message}")
    elif isinstance(ev, SweepCellFinished):
        report, _ = sweep_flow.read_report(out, partial=True)
        pane.fill_cells(report.as_compare_result())
        if ev.status != "ok":
            app.notify(f"{ev.label}: {ev.error}", title="sweep cell failed", severity="warning", timeout=6)


def _ended(app, out: str, report, error: str | None) -> None:
    pane = app.compare_pane
    pane.running = False
    label = pane.query_one("#cmp-status", Label)
    if report is not None:
        pane.status = "done"
        failed = len(report.failed)
        pane.show_result(report.as_compare_result(), note=f"sweep {report.name}: {len(report.cells)} cells"
                         + (f", {failed} failed" if failed else "") + f" · {out} · enter opens a cell in Run")
        app.notify(f"sweep done: {len(report.cells)} cells in {out}", title="sweep finished")
    elif error == "cancelled":
        pane.status = "cancelled"
        label.update(f"sweep cancelled: the finished cells stay in {out} (resume continues)")
    else:
        pane.status = "failed"
        label.update(f"[red]sweep failed[/]: {error}")
        app.notify(error, title="sweep failed", severity="error")
