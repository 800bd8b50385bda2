"""What the Scan and Compare panes share: an engine job in a worker thread, its cancel flag, and its ending."""

from __future__ import annotations

from collections.abc import Callable

from textual.widgets import Label


def engine_for_job(pane, what: str):
    """The loaded engine if ``pane`` may start its job now, else None (and a toast that says why)."""
    if pane.running:
        pane.app.notify(f"a {what} is already going: press escape to cancel it", severity="warning")
        return None
    engine = getattr(pane.app, "engine", None)
    if engine is None:
        pane.app.notify("the model is still loading (or failed to load)", severity="warning")
    return engine


def notify_policy_warnings(app, engine, *policies) -> list[str]:
    """A toast per policy fitted on another model (``Engine.policy_warning``), before the job runs; the warnings."""
    shown = []
    for pol in policies:
        try:
            warning = engine.policy_warning(pol)
        except ValueError:  # a policy that does not parse: the job's own check says why
            warning = None
        if warning and warning not in shown:
            app.notify(warning, title="policy fitted on another model", severity="warning", timeout=15)
            shown.append(warning)
    return shown


def run_engine_job(job: Callable[[], object]) -> tuple[object | None, str | None, bool]:
    """Run ``job`` (an engine call raising ``Cancelled`` when cancelled) -> ``(result, error, cancelled)``: the
    engine's typed result (``ScanResult``, ``CompareResult``), as the pane shows and the session keeps it.
    Any failure becomes a one-line message for the pane; the app keeps running."""
    from tqbench.engine.generate import Cancelled

    try:
        result = job()
    except Cancelled:
        return None, None, True
    except Exception as exc:
        return None, (str(exc).splitlines()[0] if str(exc) else type(exc).__name__), False
    return result, None, False


def cancel_job(pane, status_id: str) -> bool:
    """Escape: set the pane's cancel flag while its job runs (the engine stops at its next check)."""
    if not pane.running:
        return False
    pane._cancel.set()
    pane.query_one(status_id, Label).update("cancelling ...")
    return True


def finish_job(pane, msg, status_id: str, what: str) -> None:
    """The job's ``Finished`` message: failed (named, notified), cancelled (nothing kept) or done (shown)."""
    pane.running = False
    label = pane.query_one(status_id, Label)
    if msg.error:
        pane.status = "failed"
        label.update(f"[red]{what} failed[/]: {msg.error}")
        pane.app.notify(msg.error, title=f"{what} failed", severity="error")
    elif msg.cancelled:
        pane.status = "cancelled"
        label.update("cancelled: nothing was kept")
    else:
        pane.status = "done"
        pane.show_result(msg.result)
