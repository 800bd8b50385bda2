"""``allocate``: the least-KL per-layer policy under a bits/element budget, verified on held-out text, saved.

Heavy imports happen inside the command. Exit codes: 0 = done, 1 = a gate failed (``--max-kl``), 2 = bad input,
130 = cancelled (Ctrl-C; rerun with the same ``--resume`` file to continue from the measured cells).
"""

from __future__ import annotations

import os
import sys

import click

from tqbench.cli.options import check_max_kl, check_out_path, csv, fail, friendly_errors, gate, model_options
from tqbench.constants import ALLOCATE_CODECS


@click.command()
@model_options
@click.option("--budget", type=float, required=True,
              help="Bits per KV element for the whole cache (all metadata, sinks and window included): above the "
                   "cheapest codec's bits and below 16.")
@click.option("--context", "--seq-len", "context", type=click.IntRange(min=1), default=1024, show_default=True,
              help="The context length (tokens) the budget is stated at and the allocation is solved for: fixed "
                   "bytes (rotations, sliding windows, sinks) weigh less as it grows, so the budget at 1,024 tokens "
                   "is not the budget at 8K. The report names it.")
@click.option("--calibration", default="mix", show_default=True,
              help="Calibration: 'mix' (the shipped prose, code, legal and chat texts, one sequence per kind), a "
                   "shipped text (bread, corpus:lighthouses, heldout:code, calibration:prose ...) or a UTF-8 file.")
@click.option("--calib-prefill", type=int, default=1024, show_default=True,
              help="Tokens of each calibration sequence prefilled exactly before the scored steps.")
@click.option("--calib-steps", type=int, default=32, show_default=True,
              help="Tokens after the prefill (per calibration sequence) whose next-token KL scores each cell.")
@click.option("--granularity", type=click.Choice(["layer", "head"]), default="layer", show_default=True,
              help="One codec per layer and role, or per KV head.")
@click.option("--codecs", default=",".join(ALLOCATE_CODECS), show_default=True,
              help="Codec choices per unit (V; K too unless --k-codecs). q8_0 is dropped from the default where "
                   "the head dim is not a multiple of 32; choices no unit can afford are not measured.")
@click.option("--k-codecs", default=None,
              help="K choices (default: --codecs plus pcaq2,pcaq3,pcaq4 when the model has a calibrated fit).")
@click.option("--sink", type=click.IntRange(min=0), default=4, show_default=True,
              help="fp16 sink tokens the cells are measured at.")
@click.option("--recent", type=click.IntRange(min=0), default=16, show_default=True,
              help="fp16 recent window the cells are measured at.")
@click.option("--base", default="", show_default=False,
              help="Codec options and layer plan every candidate shares, as policy keys without codecs or "
                   "protection, e.g. 'rotation=hadamard,sliding=compress' (compress sliding-window layers too).")
@click.option("--sinks", default=None,
              help="Sink options searched (each x --recents, measured jointly); '' for --sink only. Default: the "
                   "allocator's grid (docs/allocation.md; --sink only when every layer slides).")
@click.option("--recents", default=None,
              help="Recent-window options searched. Default: the allocator's grid "
                   "(docs/allocation.md; with 0 too where sliding-window layers are compressed).")
@click.option("--max-measurements", type=click.IntRange(min=0), default=24, show_default=True,
              help="Joint measurements (protection options + exchange steps); 0: the additive solution only.")
@click.option("--verify-text", default="rivers", show_default=True,
              help="Text for teacher-forced verification (not a calibration text); 'none' skips it.")
@click.option("--unseen-text", default="heldout:technical", show_default=True,
              help="A second unseen text of another kind, verified the same way; 'none' skips it.")
@click.option("--verify-prefill", type=int, default=1024, show_default=True,
              help="Teacher-forced verification: prefill tokens of each verify text.")
@click.option("--verify-steps", type=int, default=256, show_default=True,
              help="Teacher-forced verification: scored tokens after the prefill, per verify text.")
@click.option("--name", default=None, help="Policy name (default: the --out file's stem, else alloc-<budget>bit).")
@click.option("--out", default=None,
              help="Write the policy artifact here (.toml, + .safetensors sidecar). Without it nothing is saved.")
@click.option("--resume", "resume", default=None,
              help="Partial results file (read if present, updated per cell; default <out>.partial.json).")
@click.option("--max-kl", type=float, default=None,
              help="Gate: exit 1 when the verified KL (the worse of the two texts) is above this.")
@click.option("--min-speed", default="turbo4", show_default=True,
              help="Decode tokens/s relative to a dense cache at --context (fused mode, predicted by a cost model "
                   "measured on this machine once): a ratio above 0, turbo4 (no slower than uniform turbo4) or none.")
@click.option("--verify-speed", is_flag=True,
              help="Also decode the chosen policy (fused) against dense and report the measured speed ratio.")
@click.option("--axes", default="bits", show_default=True,
              help="What the budget is spent on: bits (codec widths), tokens (a keep fraction per layer: token "
                   "eviction by the base's score, fp16 rows) or bits,tokens (both, jointly).")
@click.option("--keeps", default="1.0,0.75,0.5,0.25", show_default=True,
              help="Keep fractions offered per layer with the tokens axis.")
@click.option("--keep-granularity", type=click.Choice(["layer", "head"]), default="layer", show_default=True,
              help="One keep fraction per layer, or per KV head (keep@L=f0|f1|f2 where a layer's heads differ; "
                   "with --granularity head and the tokens axis).")
@click.option("--demote-codecs", default="none", show_default=True,
              help="With the tokens axis, codecs a layer's evicted rows may be kept at instead of dropped (the demote "
                   "tier, chosen per layer: demote@LAYERS=codec), e.g. turbo2,turbo1; none: always dropped.")
@click.option("--probes", type=int, default=None,
              help="With the tokens axis, needle probes every keep cell is also priced on (the answer tokens' KL with "
                   "that layer evicting; filler from the calibration texts, held out from the task suite); 0: the "
                   "calibration KL alone (the default: opt-in, see docs/allocation.md).")
@click.option("--probe-weight", type=float, default=None, help="Weight of the probes' price beside the calibration "
                                                                 "KL (default 1).")
@click.option("--probe-protocols", default="agnostic,aware", show_default=True,
              help="Where the probes evict: agnostic (before the question), aware (after it) or both (the mean).")
@click.option("--probe-context", type=int, default=None, help="Probe length in tokens (default: --calib-prefill, at least 512).")
@click.option("--rotation", type=click.Choice(["auto", "qr", "hadamard"]), default="auto", show_default=True,
              help="The turbo codecs' rotation: auto (the randomized Hadamard where a dense QR rotation's bytes weigh "
                   "in the budget, e.g. head_dim 256 at 1K tokens), qr or hadamard.")
@click.option("--fit-transforms/--no-fit-transforms", default=True, show_default=True,
              help="Fit this model's calibrated key transforms (pcaq) when it has none (cached per model).")
@click.option("--compare-uniform/--no-compare-uniform", default=True, show_default=True,
              help="Verify the uniform policy of no more bytes beside the allocation and warn when the allocation "
                   "is far worse.")
@click.option("--json", "as_json", is_flag=True, help="Print the JSON report on stdout.")
@friendly_errors
def allocate(model, device, dtype, threads, budget, context, calibration, calib_prefill, calib_steps, granularity,
             codecs, k_codecs, sink, recent, base, sinks, recents, max_measurements, verify_text, unseen_text,
             verify_prefill, verify_steps, name, out, resume, max_kl, min_speed, verify_speed, axes, keeps, keep_granularity, demote_codecs,
             probes, probe_weight, probe_protocols, probe_context, rotation, fit_transforms, compare_uniform, as_json):
    """The best per-layer (or per-KV-head) KV policy under --budget bits/element: measure, solve exactly, measure
    jointly, verify on two unseen texts, save (with --out)."""
    import json

    check_max_kl(max_kl)  # the torch-free checks first: one line in well under a second
    check_out_path(out, "--out", ".toml")
    if resume is None and out is not None:
        resume = out[: -len(".toml")] + ".partial.json"
    check_out_path(resume, "--resume")
    from tqbench.cli.render.allocate import print_allocation, print_phases
    from tqbench.cli.render.console import err, load_engine
    from tqbench.cli.render.progress import EventProgress
    from tqbench.engine.allocate.exchange import RECENT_GRID, SINK_GRID
    from tqbench.engine.allocate.retrieval import DEFAULT_PROBES
    from tqbench.engine.allocate.spec import AllocateSpec

    try:
        grid = None if sinks is None and recents is None else [
            (int(a), int(b)) for a in (list(SINK_GRID) if sinks is None else csv(sinks)) or []
            for b in (list(RECENT_GRID) if recents is None else csv(recents)) or []]
    except ValueError:
        raise ValueError(f"--sinks {sinks!r} / --recents {recents!r} must be comma-separated token counts, "
                         "e.g. 4,16,64") from None
    if any(a < 0 or b < 0 for a, b in grid or []):
        raise ValueError("--sinks and --recents must be 0 or more tokens")
    policy_name = name or (os.path.splitext(os.path.basename(out))[0] if out else None)
    # the engine's rules, checked once, before the model loads
    spec = AllocateSpec(
        budget, calibration=calibration, calib_prefill=calib_prefill, calib_steps=calib_steps,
        codecs=csv(codecs) or [], k_codecs=csv(k_codecs) if k_codecs else None, granularity=granularity,
        base=allocation_base(base, sink, recent), context=context, protections=grid,
        max_measurements=max_measurements, verify_text=None if verify_text.lower() == "none" else verify_text,
        unseen_text=None if unseen_text.lower() == "none" else unseen_text, verify_prefill=verify_prefill,
        verify_steps=verify_steps, name=policy_name, partial_path=resume, min_speed=min_speed,
        verify_speed=verify_speed, axes=axes, keeps=keeps, keep_granularity=keep_granularity,
        demote_codecs=demote_codecs, rotation=rotation, fit_transforms=fit_transforms,
        compare_uniform=compare_uniform, probe_protocols=probe_protocols, probe_context=probe_context,
        probes=DEFAULT_PROBES if probes is None else probes, **({} if probe_weight is None else {"probe_weight": probe_weight}))
    from tqbench.engine import Cancelled, allocate_policy, save_policy_artifact

    if not out:
        err.print(not_saved(resume), highlight=False, markup=False, soft_wrap=True)
    engine = load_engine(model, device, dtype, threads, quiet=as_json)
    try:
        # progress on stderr in every phase, --json too (stdout holds the report): plain lines when stderr is
        # not a terminal (a log file), where a live bar draws nothing
        with EventProgress(label="allocate", lines=not err.is_terminal) as prog:
            rep = allocate_policy(engine, budget, spec=spec, on_event=prog)
    except (Cancelled, KeyboardInterrupt):
        hint = f"; rerun with --resume {resume} to continue" if resume else ""
        click.echo(f"allocate cancelled{hint}", err=True)
        sys.exit(130)
    payload = rep.to_dict()
    if not out:
        err.print(not_saved(resume), highlight=False, markup=False, soft_wrap=True)
    if out:
        from tqbench.engine.calibrate import save_beside

        artifact = rep.to_artifact(engine.geometry)
        artifact.policy = save_beside(artifact.policy, out)[0]  # calibrated keys: their transforms beside the TOML
        path = save_policy_artifact(artifact, out)
        payload["out"] = str(path)
        if not as_json:
            err.print(f"wrote {path}" + f" and {path.with_suffix('.safetensors').name}")
    if as_json:
        click.echo(json.dumps(payload, indent=2))
    else:
        print_allocation(rep)
    print_phases(rep)  # stderr: the per-phase wall and CPU seconds (and in --json's "seconds")
    for warning in rep.warnings:
        click.echo(f"warning: {warning}", err=True)
    if max_kl is not None:
        worst = rep.worst_verified_kl
        if worst is None:
            fail("--max-kl needs verification: drop --verify-text none / --unseen-text none")
        text = max((p for p in (rep.verified, rep.unseen) if p is not None), key=lambda p: p.kl_mean).text
        gate(worst <= max_kl, f"verified KL {worst:.4f} on {text} > --max-kl {max_kl:g}")


def not_saved(resume: str | None) -> str:
    """Said before the job and after it when there is no --out."""
    if resume:
        return (f"allocate: no --out, so the policy is not saved (the measured cells are kept in {resume}): add "
                "--out FILE.toml to write it")
    return ("allocate: no --out, so nothing is saved (neither the policy nor the measured cells): add --out "
            "FILE.toml to write the policy and keep the cells for a rerun")


#: policy keys ``--base`` may not set: the allocation chooses the codecs, --sink/--recent give the protection
_NOT_IN_BASE = ("k", "v", "kv", "sink", "recent", "protect", "overrides")


def allocation_base(base: str, sink: int, recent: int) -> str:
    """``--base`` plus ``sink=..,recent=..`` as one policy string (checked: no codecs, no protection)."""
    parts = [part.strip() for part in base.split(",") if part.strip()]
    bad = [p for p in parts if "=" not in p or p.split("=", 1)[0].strip() in _NOT_IN_BASE or "@" in p]
    if bad:
        raise ValueError(f"--base {base!r} must hold codec options and the layer plan only (e.g. "
                         "rotation=hadamard,sliding=compress): the allocation picks the codecs; give the protection "
                         "with --sink/--recent")
    return ",".join([*parts, f"sink={sink}", f"recent={recent}"])
