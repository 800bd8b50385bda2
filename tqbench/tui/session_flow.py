"""Sessions in the workbench: open (``--session FILE``, ctrl+o), save (ctrl+s) and the model check.

A session whose tokens carry their texts (format version 2) shows at once, whether the model has loaded or
not; an older one needs the model's tokenizer to rebuild the texts, so it opens as soon as the model has
loaded. Errors are shown as notifications and the app keeps running.
"""

from __future__ import annotations

from pathlib import Path

from tqbench.sessions import (
    Session,
    SessionError,
    new_session_path,
    read_header,
    restore_token_texts,
    save_session,
)
from tqbench.tui import sweep_flow


def use_session_model(app, path: str) -> bool:
    """``--session FILE`` without ``--model``: the app loads the session's model; False (and shown) when the
    file cannot be read."""
    if sweep_flow.is_sweep_dir(path):
        app.model_spec = sweep_flow.sweep_model(path)
        return True
    try:
        app.model_spec = read_header(path).get("model", {}).get("spec") or "default"
    except SessionError as exc:
        app.notify(str(exc), title="cannot open session", severity="error", timeout=10)
        return False
    return True


def open_session(app, path) -> bool:
    """Load a session and show its last run (and its last scan and comparison); True when it is shown.
    A sweep directory opens in the Compare tab (``sweep_flow``)."""
    if sweep_flow.is_sweep_dir(path):
        return sweep_flow.open_sweep(app, path)
    if app.busy:
        app.notify("work is going: press escape first, then open the session", severity="warning")
        return False
    try:
        session = Session.load(path)
    except SessionError as exc:
        app.notify(str(exc), title="cannot open session", severity="error", timeout=10)
        return False
    if not session.has_token_texts:
        if app.engine is None:  # a version-1 file: its texts are rebuilt with the model's tokenizer
            app.pending_session = str(path)
            app.notify(f"{Path(path).name} opens as soon as the model has loaded", timeout=4)
            return False
        restore_token_texts(session.runs, app.engine.tokenizer)
    app.session, app.session_path = session, Path(path)
    if app.engine is not None:
        warn_if_other_model(app)
    show_session(app, session)
    app.notify(f"opened {Path(path).name}: {len(session.runs)} run(s), {len(session.scans)} scan(s), "
               f"{len(session.compares)} comparison(s), {len(session.validations)} validation(s), "
               f"{len(session.tasks)} task-suite result(s)",
               title="session opened")
    return True


def show_session(app, session: Session) -> None:
    app.policies_pane.set_kept(app.policies_pane.kept | session.policies)
    if session.scans:
        app.scan_pane.show_result(session.scans[-1], note=f"saved scan ({len(session.scans)} in the session)")
    if session.compares:
        app.compare_pane.show_result(session.compares[-1],
                                     note=f"saved comparison ({len(session.compares)} in the session)")
    if session.tasks:
        from tqbench.tui.panes.compare_tasks import CompareTasks

        app.compare_pane.query_one(CompareTasks).show_saved(session.tasks)
    app.saved_record = session.runs[-1] if session.runs else None
    if session.runs:
        app.run_pane.show_record(app.saved_record)
        app.show_run()
    elif session.scans:
        app.action_tab("scan")
    elif session.compares or session.tasks:
        app.action_tab("compare")


def warn_if_other_model(app) -> None:
    """The opened session was made with another model than the loaded one: re-runs will differ."""
    model, loaded = app.session.model, app.engine.loaded
    fp = model.get("fingerprint")
    if fp and fp != loaded.fingerprint:
        app.notify(f"this session was made with {model.get('name')} (fingerprint {fp}); the loaded model is "
                   f"{app.engine.name} ({loaded.fingerprint}): re-runs will differ",
                   title="different model", severity="warning", timeout=10)


def save_as(app) -> None:
    """"Save session as": ask for a file name (the current one, else a new one in the session dir), then save."""
    from tqbench.tui.screens.sessions import SaveAsScreen

    default = app.session_path or new_session_path(app.session, app.options.session_dir)
    app.push_screen(SaveAsScreen(str(default)), lambda path: save(app, path) if path else None)


def save(app, path=None) -> None:
    """ctrl+s: the session to its file (a new one in the session dir the first time); ``path``: save as. An
    existing session file is kept as ``NAME.bak.json`` (and said); any other existing file is refused."""
    if app.engine is None:
        app.notify("nothing to save yet: the model is still loading", severity="warning")
        return
    if app.busy:
        app.notify("work is going: wait for it or press escape, then save", severity="warning")
        return
    app.session.policies.update(app.policies_pane.kept)
    path = path or app.session_path or new_session_path(app.session, app.options.session_dir)
    try:
        app.session_path = save_session(app.session, path, engine=app.engine, model_spec=app.model_spec)
    except (OSError, SessionError, ValueError) as exc:
        app.notify(f"could not save the session to {path}: {exc}", title="save failed", severity="error")
        return
    kept = f"; the previous version kept as {app.session.backup.name}" if app.session.backup else ""
    app.notify(f"saved {len(app.session.runs)} run(s) to {app.session_path}{kept}", title="session saved")
    app.sub_title = str(app.session_path)
