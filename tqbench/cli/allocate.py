"""``allocate``: the least-KL per-layer policy under a bits/element budget, verified on held-out text, saved.

Heavy imports happen inside the command. Exit codes: 0 = done, 1 = a gate failed (``--max-kl``), 2 = bad input,
130 = cancelled (Ctrl-C; rerun with the same ``--resume`` file to continue from the measured cells).
"""

from __future__ import annotations

import os
import sys

import click

from tqbench.cli.options import csv, fail, friendly_errors, gate, model_options


@click.command()
@model_options
@click.option("--budget", type=float, required=True,
              help="Bits per KV element for the whole cache (all metadata, sinks and window included).")
@click.option("--context", type=click.IntRange(min=1), default=1024, show_default=True,
              help="The context length (tokens) the budget is stated at: bits/element fall as context grows.")
@click.option("--calibration", default="lighthouses", show_default=True,
              help="Calibration text: a shipped corpus name (bread, lighthouses, rivers) or a UTF-8 text file.")
@click.option("--calib-prefill", type=int, default=1024, show_default=True)
@click.option("--calib-steps", type=int, default=64, show_default=True,
              help="Tokens after the prefill whose next-token KL scores each cell.")
@click.option("--granularity", default="layer", show_default=True,
              help="layer (per-KV-head allocation is not implemented: the store keeps one width per layer).")
@click.option("--codecs", default="turbo1,turbo2,turbo3,turbo4", show_default=True,
              help="Codec choices per layer and role.")
@click.option("--sink", type=click.IntRange(min=0), default=4, show_default=True, help="fp16 sink tokens.")
@click.option("--recent", type=click.IntRange(min=0), default=16, show_default=True, help="fp16 recent window.")
@click.option("--verify-text", default="rivers", show_default=True,
              help="Shipped text for teacher-forced verification (not the calibration text); 'none' skips it.")
@click.option("--verify-prefill", type=int, default=1024, show_default=True)
@click.option("--verify-steps", type=int, default=256, show_default=True)
@click.option("--name", default=None, help="Policy name (default: the --out file's stem, else alloc-<budget>bit).")
@click.option("--out", default=None, help="Write the policy artifact here (.toml, + .safetensors sidecar).")
@click.option("--resume", "resume", default=None,
              help="Partial results file (read if present, updated per cell; default <out>.partial.json).")
@click.option("--max-kl", type=float, default=None, help="Gate: exit 1 when the verified KL is above this.")
@click.option("--json", "as_json", is_flag=True, help="Print the JSON report on stdout.")
@friendly_errors
def allocate(model, device, dtype, threads, budget, context, calibration, calib_prefill, calib_steps, granularity,
             codecs, sink, recent, verify_text, verify_prefill, verify_steps, name, out, resume, max_kl, as_json):
    """The best per-layer KV policy under --budget bits/element: measure, solve exactly, verify, save."""
    import json

    from tqbench.cli.render.allocate import print_allocation
    from tqbench.cli.render.console import err, load_engine
    from tqbench.cli.render.progress import EventProgress
    from tqbench.engine import Cancelled, allocate_policy, save_policy_artifact

    if out is not None:
        if not out.endswith(".toml"):
            raise ValueError(f"--out {out!r} must end in .toml (the policy artifact)")
        parent = os.path.dirname(os.path.abspath(out))
        if not os.path.isdir(parent):
            raise ValueError(f"--out {out!r}: folder {parent!r} does not exist; create it or pick another path")
    if resume is None and out is not None:
        resume = out[: -len(".toml")] + ".partial.json"
    verify = None if verify_text.lower() == "none" else verify_text
    engine = load_engine(model, device, dtype, threads, quiet=as_json)
    policy_name = name or (os.path.splitext(os.path.basename(out))[0] if out else None)
    try:
        with EventProgress(enabled=not as_json, label="allocate") as prog:
            rep = allocate_policy(
                engine, budget, calibration=calibration, calib_prefill=calib_prefill, calib_steps=calib_steps,
                codecs=csv(codecs) or [], granularity=granularity, base=f"sink={sink},recent={recent}",
                context=context, verify_text=verify, verify_prefill=verify_prefill, verify_steps=verify_steps,
                name=policy_name, partial_path=resume, on_event=prog)
    except (Cancelled, KeyboardInterrupt):
        hint = f"; rerun with --resume {resume} to continue" if resume else ""
        click.echo(f"allocate cancelled{hint}", err=True)
        sys.exit(130)
    payload = rep.to_dict()
    if out:
        path = save_policy_artifact(rep.to_artifact(engine.geometry), out)
        payload["out"] = str(path)
        if not as_json:
            err.print(f"wrote {path}" + f" and {path.with_suffix('.safetensors').name}")
    if as_json:
        click.echo(json.dumps(payload, indent=2))
    else:
        print_allocation(rep)
    if max_kl is not None:
        if rep.verified is None:
            fail("--max-kl needs verification: drop --verify-text none")
        gate(rep.verified.kl_mean <= max_kl, f"verified KL {rep.verified.kl_mean:.4f} > --max-kl {max_kl}")
