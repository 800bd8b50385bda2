"""Headless and workbench are one product: the glue between click commands and the Textual app.

- ``open_workbench(ctx, screen, ...)`` opens the TUI with the CLI's flags filled into a screen;
- ``@workbench_command(screen, to_fields)`` makes a headless command open the workbench on its screen when
  ``--headless`` is not given, and adds ``--save-session FILE`` to it;
- ``save_session_if_asked(engine, model, ...)`` writes the session the command produced (one line per command).

Textual is imported only when the workbench really opens, so ``tqbench --help`` stays fast.
"""

from __future__ import annotations

import functools
import os
import sys

import click

from tqbench.constants import DEFAULT_PROMPT

_META = "tqbench.save_session"


def _fail(message: str) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(2)


def open_workbench(ctx: click.Context, screen: str = "run", run: dict | None = None, scan: dict | None = None,
                   compare: dict | None = None) -> None:
    """Open the Textual workbench with the group's flags (and a subcommand's, filled into its screen)."""
    wb = dict(ctx.find_root().obj["workbench"])
    sweep_dir = wb["session"] and os.path.isfile(os.path.join(wb["session"], "sweep.json"))
    if wb["session"] and not (os.path.isfile(wb["session"]) or sweep_dir):
        _fail(f"session file {wb['session']!r} does not exist: give a saved session's .json path "
              "or a sweep's --out folder")
    if not (sys.stdin.isatty() and sys.__stderr__.isatty()):
        _fail("the workbench needs a terminal: run `tqbench` in one, or use `tqbench --headless <command>`")
    from tqbench.tui.app import RunParams, WorkbenchOptions, run_workbench

    params = None
    if run is not None or wb["policy"]:
        r = dict(prompt=DEFAULT_PROMPT, chat=True, max_new_tokens=48, temperature=0.0, top_p=1.0, seed=0,
                 baseline="fp16", candidate=wb["policy"] or "turbo4", cache_mode=None)  # None: the device's mode
        r.update({k: v for k, v in (run or {}).items() if v is not None})
        params = RunParams(**r)
    run_workbench(WorkbenchOptions(model=wb["model"], device=wb["device"], dtype=wb["dtype"], threads=wb["threads"],
                                   session=wb["session"], session_dir=wb["session_dir"], screen=screen, run=params,
                                   scan=scan or {}, compare=compare or {}))


def workbench_command(screen: str, to_fields=None):
    """Decorate a command function (below ``@main.command()``): without --headless it opens the workbench on
    ``screen`` with ``to_fields(kwargs)`` filled in; with it, runs headless; adds ``--save-session``."""

    def deco(fn):
        @functools.wraps(fn)
        def wrapper(*args, save_session=None, **kwargs):
            ctx = click.get_current_context()
            root = ctx.find_root()
            if not root.obj.get("headless"):
                for key in ("model", "device", "dtype", "threads"):
                    if kwargs.get(key) is not None:
                        root.obj["workbench"][key] = kwargs[key]
                fields = to_fields(kwargs) if to_fields else {}
                return open_workbench(ctx, screen, **({screen: fields} if fields else {}))
            check_session_path(save_session)
            ctx.meta[_META] = save_session
            return fn(*args, **kwargs)

        return click.option("--save-session", "save_session", default=None, metavar="FILE",
                            help="Also save the result as a workbench session (FILE.json + FILE.safetensors); "
                                 "`tqbench --session FILE` opens it.")(wrapper)

    return deco


def check_session_path(path: str | None) -> None:
    """``--save-session FILE``, checked before any work by the rule every output path follows."""
    from tqbench.cli.options import check_out_path

    try:
        check_out_path(path, "--save-session")
        if path:  # the overwrite rule (sessions.store.keep_backup), checked before any work is done
            from pathlib import Path

            from tqbench.sessions.store import SUFFIX, read_header

            target = Path(path if path.endswith(SUFFIX) else path + SUFFIX)
            if target.exists():
                read_header(target)
    except ValueError as exc:
        msg = str(exc)
        if path and "session" in msg and "--save-session" not in msg:
            msg = f"--save-session {path}: that file exists and is not a tqbench session ({msg}): it is not " \
                  "overwritten; give another file name"
        _fail(msg)


def save_session_if_asked(engine, model_spec: str, **results) -> str | None:
    """Write the session when the command got ``--save-session`` (``runs=``, ``scans=`` (``ScanResult``),
    ``compares=`` (``CompareResult``), ``validations=``); a validation is its report (``ValidationReport`` / ``TeacherForcedReport``, stored as
    its ``to_dict()``), and a validation's lockstep run also becomes a run the Run screen shows."""
    path = click.get_current_context().meta.get(_META)
    if not path:
        return None
    from tqbench.sessions import Session, record_from_validation, save_session

    runs = list(results.pop("runs", []))
    validations = []
    for report in results.pop("validations", []):
        rec = record_from_validation(report)
        if rec is not None:
            runs.append(rec)
        validations.append(report if isinstance(report, dict) else report.to_dict())
    session = Session(runs=runs, validations=validations, **results)
    saved = str(save_session(session, path, engine=engine, model_spec=model_spec))
    kept = f" (the previous version kept as {session.backup})" if session.backup else ""
    click.echo(f"session saved to {saved}{kept}", err=True)
    return saved


# ---- flags -> screen fields ----------------------------------------------------------------------------
def _prompt(kwargs: dict) -> str | None:
    if kwargs.get("prompt_file"):
        with open(kwargs["prompt_file"], encoding="utf-8") as fh:
            return fh.read()
    return kwargs.get("prompt")


def validate_fields(kw: dict) -> dict:
    return {"prompt": _prompt(kw), "chat": kw.get("chat"), "max_new_tokens": kw.get("max_new_tokens"),
            "temperature": kw.get("temperature"), "seed": kw.get("seed"), "baseline": kw.get("baseline"),
            "candidate": kw.get("candidate"), "cache_mode": kw.get("cache_mode")}


def scan_fields(kw: dict) -> dict:
    fields = {"prompt": _prompt(kw), "layers": kw.get("layers"), "codecs": kw.get("codecs"),
              "max_prompt_tokens": kw.get("max_prompt_tokens")}
    return {k: v for k, v in fields.items() if v is not None}


def compare_fields(kw: dict) -> dict:
    prompts = list(kw.get("prompts") or ())
    for f in kw.get("prompt_files") or ():
        with open(f, encoding="utf-8") as fh:
            prompts.append(fh.read().replace("\n", " "))
    fields = {"policies": "; ".join(kw.get("policies") or ()) or None, "baseline": kw.get("baseline"),
              "max_new_tokens": kw.get("max_new_tokens"), "cache_mode": kw.get("cache_mode"),
              "prompts": "\n".join(prompts) if prompts else None}
    return {k: v for k, v in fields.items() if v is not None}
