"""``tasks``: the long-context task suite (RULER-style, ``engine.tasks``), baseline vs one candidate policy.

Bad input (an unknown task, a context too short for a task or above the model's, a bad sample count or policy) is
a one-line error and exit 2 before the model loads (the context is checked against a shipped model's config;
another model's limit is checked once it has loaded, still before any generation). Exit 1: ``--max-drop`` gate.
"""

from __future__ import annotations

import click

from tqbench.cli.options import (
    check_out_paths,
    csv,
    friendly_errors,
    gate,
    model_options,
    policy_option,
    report_options,
    write_reports,
)
from tqbench.constants import CACHE_MODE_HELP, CACHE_MODES, DEFAULT_CACHE_MODE, DEFAULT_TASK_CONTEXT


def _known_max_context(model: str) -> tuple[int | None, str]:
    """The context limit of a shipped model config (``kv-estimate``'s geometry), without loading weights."""
    from tqbench.engine.cache import model_geometry

    try:
        geo = model_geometry(model)
    except (ValueError, OSError):
        return None, model
    return geo.max_context, geo.name


def _check_peer(peer: str, presses, ratios, keep) -> tuple:
    """The peer's Python, presses and ratios, checked before the model loads (a missing peer environment is one
    line naming the command that creates it)."""
    from tqbench.engine.tasks.peer import check_presses, check_ratios, peer_python

    python = peer_python(peer)
    presses = check_presses(presses)
    if ratios is None:
        if not (isinstance(keep, float) and 0 < keep < 1):
            raise ValueError("--peer-ratios is needed: the candidate keeps no single fraction of the rows (give "
                             "e.g. --peer-ratios 0.5, or a candidate with keep=0.5)")
        ratios = (round(1 - keep, 6),)
    return python, presses, check_ratios(ratios)


def _run_peer(engine, suite, res, peer, python, presses, ratios, protocols, prog) -> None:
    """The peer on ``suite``'s samples; its rows join ``res`` (``TasksResult.peer_samples``)."""
    from tqbench.cli.options import fail
    from tqbench.engine.tasks.peer import PeerError, build_request, references_of, run_peer, score_peer

    request = build_request(engine, suite, presses, ratios, protocols)
    try:
        result = run_peer(request, python, on_event=prog)
    except PeerError as exc:  # the peer's own one line, exit 1 (it ran and failed: not bad input)
        fail(str(exc), 1)
    keep = engine.check_policy(res.candidate).policy.keep
    res.candidate_ratio = round(1 - keep, 6) if isinstance(keep, float) else None
    res.peer = {"name": peer, "presses": list(presses), "ratios": list(ratios), "python": str(python),
                "versions": result.get("versions", {})}
    res.peer_samples = score_peer(result["answers"], references_of(res.to_dict()), peer)


def _show_peer(res, leaderboard_dir, quiet: bool) -> None:
    from pathlib import Path

    from tqbench.cli.render.peer import plot_svg, plot_terminal, print_side_by_side

    sbs = res.side_by_side()
    if not quiet:
        print_side_by_side(sbs)
        for protocol in res.protocols:
            plot_terminal(sbs, protocol)
    if leaderboard_dir:
        from tqbench.engine.tasks.peer import write_leaderboard

        folder = Path(leaderboard_dir)
        write_leaderboard(sbs, folder, {"context": res.context, "seed": res.seed, "cache_mode": res.cache_mode,
                                        "baseline": res.baseline, "peer": res.peer})
        (folder / "score-vs-ratio.svg").write_text(plot_svg(sbs), encoding="utf-8")


@click.command()
@model_options
@click.option("--context", type=int, default=DEFAULT_TASK_CONTEXT, show_default=True,
              help="Target context in tokens (prompt + answer) of every sample, e.g. 2048, 4096, 8192.")
@policy_option("--candidate", default=None,
               help="The policy under test (one policy). Default: the model's (turbo4; on a model mixing sliding-window "
                    "and global layers, the hybrid default: tqbench.engine.policy.default).")
@policy_option("--baseline", default="fp16", show_default=True,
              help="The reference policy (or dense cache) the candidate is scored against; its answers are cached.")
@click.option("--cache-mode", type=click.Choice(CACHE_MODES), default=DEFAULT_CACHE_MODE, show_default=True,
              help=CACHE_MODE_HELP)
@click.option("--tasks", "task_names", default=None, help="Comma-separated tasks (default: the ones the default model can do; see docs/validation.md).")
@click.option("--samples", type=int, default=None, help="Samples per task (default 3).")
@click.option("--seed", type=int, default=0, show_default=True, help="Sample seed.")
@click.option("--protocol", default="both", show_default=True,
              help="agnostic (the context compressed once before the question, which is appended to the compressed "
                   "cache), aware (the question inside the compressed prompt), or both (separate rows).")
@click.option("--peer", type=click.Choice(["kvpress"]), default=None,
              help="Also run a peer library's methods on the same samples and model, rows in the same table: kvpress "
                   "(NVIDIA kvpress in its own venv, `make kvpress-env`; TQBENCH_KVPRESS_PYTHON names another).")
@click.option("--peer-presses", default=None,
              help="Comma-separated kvpress presses (default snapkv,tova,kvzip,expected,knorm,chunkkv; also adakv, "
                   "streaming, none).")
@click.option("--peer-ratios", default=None,
              help="kvpress compression ratios, the fraction removed (default: 1-keep of the candidate), e.g. "
                   "0.25,0.5,0.75,0.875.")
@click.option("--leaderboard", "leaderboard_dir", default=None, type=click.Path(file_okay=False),
              help="With --peer: write kvpress's leaderboard layout here (leaderboard.csv, one folder per method, "
                   "ratio and protocol with config, metrics, predictions) and score-vs-ratio.svg.")
@click.option("--no-cache", is_flag=True, help="Run the baseline again instead of reusing its cached answers.")
@click.option("--max-drop", type=float, default=None,
              help="Gate: exit 1 when the candidate's overall score is more than this many points below the baseline.")
@report_options
@friendly_errors
def tasks(model, device, dtype, threads, context, candidate, baseline, cache_mode, task_names, samples, seed,
          protocol, peer, peer_presses, peer_ratios, leaderboard_dir, no_cache, max_drop, report_json, report_md,
          as_json):
    """Long-context tasks (needles, variable tracking, common words, QA): baseline vs candidate scores."""
    if max_drop is not None and not max_drop >= 0:  # the torch-free checks first: one line in well under a second
        raise ValueError(f"--max-drop {max_drop:g} is invalid: give points, 0 or more (e.g. 2)")
    check_out_paths(report_json, report_md)
    from tqbench.cli.render.console import check_policies, load_engine
    from tqbench.cli.render.progress import EventProgress
    from tqbench.cli.render.tasks import print_tasks, tasks_md
    from tqbench.engine import parse_policy
    from tqbench.engine.tasks import DEFAULT_SAMPLES, check_protocols, check_tasks

    names = csv(task_names) if task_names is not None else None
    samples = DEFAULT_SAMPLES if samples is None else samples
    limit, shown = _known_max_context(model)
    check_tasks(names, context, samples, limit, shown)
    protocols = check_protocols(protocol)
    keep = parse_policy(candidate).keep if candidate is not None else None  # the default keeps every row
    parse_policy(baseline)
    if leaderboard_dir and not peer:
        raise ValueError("--leaderboard writes the side-by-side with a peer: add --peer kvpress")
    peer_job = _check_peer(peer, peer_presses, peer_ratios, keep) if peer else None  # before the model loads
    engine = load_engine(model, device, dtype, threads, quiet=as_json)
    if candidate is None:  # the model's default: turbo4, or the measured hybrid default (engine.policy.default)
        from tqbench.engine.policy import default_policy

        candidate = default_policy(engine.geometry.layer_types)
    base_pol, cand_pol = check_policies(engine, baseline, candidate)
    import sys

    from tqbench.engine.tasks import prepare_suite, score_candidate

    with EventProgress(enabled=True, label="tasks", lines=as_json or not sys.stderr.isatty()) as prog:
        suite = prepare_suite(engine, context, tasks=names, samples=samples, baseline=base_pol, cache_mode=cache_mode,
                              seed=seed, cache=not no_cache, on_event=prog)
        res = score_candidate(engine, suite, cand_pol, on_event=prog, protocols=protocols)
        if peer_job:
            _run_peer(engine, suite, res, peer, *peer_job, protocols, prog)
    payload = res.to_dict()
    md = tasks_md(res)
    if peer_job:
        from tqbench.cli.render.peer import side_by_side_md

        md += "\n" + side_by_side_md(res.side_by_side())
    write_reports(payload, md, report_json, report_md, as_json)
    if not as_json:
        print_tasks(res)
    if peer_job:
        _show_peer(res, leaderboard_dir, quiet=as_json)
    if max_drop is not None:
        worst = min(payload["overall_by_protocol"].values(), key=lambda o: o["delta"])
        gate(worst["delta"] >= -max_drop, f"overall score {worst['candidate_score']:.1f} ({worst['protocol']}) is "
                                          f"{-worst['delta']:.1f} points below the baseline's "
                                          f"{worst['baseline_score']:.1f} (allowed: {max_drop:g})")
