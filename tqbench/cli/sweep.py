"""``tqbench --headless sweep SPEC.toml``: models x policies x texts, in-process or on a Ray cluster (``--ray``).

Each finished cell is written to ``--out`` as it finishes; ``--resume`` skips the finished ones. Exit codes:
0 = every cell ran, 1 = some cells failed (named on stderr; the rest of the report stands), 2 = bad input.
"""

from __future__ import annotations

import dataclasses

import click

from tqbench.cli.options import (
    check_out_path,
    check_out_paths,
    friendly_errors,
    gate,
    report_options,
    write_reports,
)


@click.command("sweep")
@click.argument("spec_path", metavar="SPEC.toml")
@click.option("--out", default=None, help="Folder for the cell results and the report (default: sweeps/<name>).")
@click.option("--ray", "ray_address", is_flag=False, flag_value="", default=None, metavar="[ADDRESS]",
              help="Run on Ray: a cluster ADDRESS, else a running cluster, else a local one (put SPEC.toml first).")
@click.option("--resume", is_flag=True, help="Keep the finished cells in --out and run only the others.")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="Torch threads per cell runner (overrides the spec's `threads`; on Ray: CPUs per task).")
@report_options
@friendly_errors
def sweep(spec_path, out, ray_address, resume, threads, report_json, report_md, as_json):
    """Run a sweep spec (models x policies x texts) and rank the policies per model."""
    from tqbench.cli.render.console import err
    from tqbench.cli.render.progress import EventProgress
    from tqbench.cli.render.sweep import print_sweep, sweep_md
    from tqbench.engine.sweep import (
        SweepCellFinished,
        SweepDir,
        SweepModelLoaded,
        SweepPlanned,
        load_spec,
        run_sweep,
    )

    spec = load_spec(spec_path)
    if threads is not None:
        spec = dataclasses.replace(spec, threads=threads)
    out = out or f"sweeps/{spec.name}"
    check_out_path(out, "--out", folder=True)
    check_out_paths(report_json, report_md)
    use_ray = ray_address is not None
    with EventProgress(enabled=not as_json, total=None, label="sweep") as prog:
        def on_event(ev):
            if not as_json:
                if isinstance(ev, SweepPlanned):
                    err.print(f"sweep {spec.name}: {ev.total} cells, {ev.reused} reused, {ev.todo} to run "
                              f"({ev.runner}) -> {out}")
                elif isinstance(ev, SweepModelLoaded):
                    err.print(f"loaded {ev.name} ({ev.where})")
                elif isinstance(ev, SweepCellFinished) and ev.status != "ok":
                    err.print(f"[red]cell failed[/]: {ev.label}: {ev.error}", markup=True, highlight=False,
                              soft_wrap=True)
            prog(ev)

        report = run_sweep(spec, out, resume=resume, ray=use_ray, ray_address=ray_address or None,
                           on_event=on_event)
    md = sweep_md(report, out)
    SweepDir(out).write_report(report.to_dict(), md)  # report.json (as run_sweep wrote it) and report.md
    write_reports(report.to_dict(), md, report_json, report_md, as_json)
    if not as_json:
        print_sweep(report, out)
    failed = report.failed
    gate(not failed and not report.missing,
         f"{len(failed)} of {len(report.cells) + len(report.missing)} cells failed "
         f"({', '.join(c['cell_id'] for c in failed[:3])}{' ...' if len(failed) > 3 else ''}): "
         f"see {out}/cells; fix the cause and rerun with --resume")
