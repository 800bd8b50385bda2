"""``validate``: does a candidate policy change what the model says? Lockstep greedy validation, its
``--self-test`` (baseline against itself) and ``--teacher-forced`` quality.

Heavy imports happen inside the command. Exit codes: 0 = done and the gate passed, 1 = a gate failed
(named on stderr), 2 = bad input.
"""

from __future__ import annotations

import click

from tqbench.cli.options import (
    check_max_kl,
    check_out_paths,
    check_teacher_forced_flags,
    friendly_errors,
    gate,
    model_options,
    policy_option,
    prefill_chunk_option,
    prompt_text,
    report_options,
    write_reports,
)
from tqbench.cli.workbench import save_session_if_asked, validate_fields, workbench_command
from tqbench.constants import CACHE_MODE_HELP, CACHE_MODES, DEFAULT_CACHE_MODE


@click.command()
@workbench_command("run", validate_fields)
@model_options
@policy_option("--baseline", default="fp16", show_default=True, help="Baseline policy.")
@policy_option("--candidate", default=None,
               help="Candidate policy (default: the model's default policy: turbo4, or on a model that mixes "
                    "sliding-window and global layers turbo4 with the windows and the global keys at q8_0).")
@click.option("--cache-mode", type=click.Choice(CACHE_MODES), default=DEFAULT_CACHE_MODE, show_default=True,
              help=CACHE_MODE_HELP)
@click.option("--baseline-mode", type=click.Choice(CACHE_MODES), default=DEFAULT_CACHE_MODE, show_default=True,
              help="The baseline's cache mode (when the baseline is a compressed policy).")
@click.option("--prompt", default=None, help="Prompt text.")
@click.option("--prompt-file", default=None, help="Read the prompt from a file.")
@click.option("--chat/--no-chat", default=True, show_default=True, help="Wrap the prompt in the chat template.")
@click.option("--max-new-tokens", type=int, default=64, show_default=True, help="Tokens generated per run.")
@click.option("--quality-threshold", type=float, default=0.9, show_default=True,
              help="Share of matching tokens that still counts as near-stable.")
@click.option("--collect-logits", is_flag=True, help="Compare logits: KL(baseline||candidate), max |delta|.")
@click.option("--no-per-step", is_flag=True, help="Leave the per-step trace out of the report.")
@click.option("--self-test", is_flag=True, help="Baseline vs baseline through the same loop: must be exact-match.")
@click.option("--teacher-forced", is_flag=True,
              help="Teacher-forced quality instead: perplexity, KL, top-1 agreement.")
@click.option("--corpus", default=None,
              help="Teacher-forced on a shipped text (bread, lighthouses, rivers) instead of the prompt.")
@click.option("--tf-context", type=int, default=256, show_default=True, help="Teacher-forced prefill tokens.")
@click.option("--tf-tokens", type=int, default=128, show_default=True, help="Teacher-forced scored tokens.")
@click.option("--max-kl", type=float, default=None, help="Teacher-forced gate: mean KL above this fails.")
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy.")
@click.option("--seed", type=int, default=0, show_default=True, help="Sampling seed (both runs).")
@prefill_chunk_option
@report_options
@friendly_errors
def validate(model, device, dtype, threads, baseline, candidate, cache_mode, baseline_mode, prompt,
             prompt_file, chat, max_new_tokens, quality_threshold, collect_logits, no_per_step, self_test,
             teacher_forced, corpus, tf_context, tf_tokens, max_kl, temperature, seed, prefill_chunk, report_json,
             report_md, as_json):
    """Does a candidate policy change what the model says? Verdict, metrics and a recommendation."""
    from tqbench.engine import GenerationRequest, parse_policy

    _check_flags(candidate, self_test, teacher_forced, corpus, max_kl, tf_context, tf_tokens)
    check_max_kl(max_kl)
    request = GenerationRequest(max_new_tokens, temperature=temperature, seed=seed)
    base_pol, cand_pol = parse_policy(baseline), parse_policy(candidate) if candidate else None
    text = prompt_text(prompt, prompt_file)
    check_out_paths(report_json, report_md)  # the torch-free checks first: a bad path or number in well under 1 s
    from tqbench.cli.render.console import check_policies, load_engine
    from tqbench.engine.validate import check_generation_args

    if teacher_forced:
        check_teacher_forced_flags(corpus, tf_context, tf_tokens)
    check_generation_args(max_new_tokens, quality_threshold)
    engine = load_engine(model, device, dtype, threads, quiet=as_json)
    if cand_pol is None:  # the model's default: turbo4, or the measured hybrid default (engine.policy.default)
        from tqbench.engine.policy import default_policy

        cand_pol = default_policy(engine.geometry.layer_types)
    cand_pol, base_pol = check_policies(engine, cand_pol, base_pol)  # once: the runs take them as they are
    reports = dict(report_json=report_json, report_md=report_md, as_json=as_json)
    if teacher_forced:
        rep = _teacher_forced(engine, model, cand_pol, None if corpus else text, corpus, tf_context, tf_tokens,
                              cache_mode, chat, max_new_tokens, reports, prefill_chunk)
        if max_kl is not None:
            worst = max(r.kl_mean for r in rep.results)
            gate(worst <= max_kl, f"teacher-forced mean KL {worst:.5f} is above --max-kl {max_kl}")
        return
    kw = dict(chat=chat, max_new_tokens=max_new_tokens, sampling=request.sampling, collect_logits=collect_logits,
              per_step=not no_per_step, quality_threshold=quality_threshold, prefill_chunk=prefill_chunk)
    report = _lockstep(engine, model, text, base_pol, cand_pol, cache_mode, baseline_mode, self_test, kw, reports)
    if self_test:
        gate(report.passed, f"self-test verdict is {report.quality_verdict}, not exact-match: the loop is "
             "not deterministic")
    elif report.storage_only:
        click.echo("note: dense-shadow is storage-only: no quality verdict is claimed", err=True)
    else:
        gate(report.passed, f"verdict {report.quality_verdict} (needs exact-match or near-stable at "
             f"--quality-threshold {quality_threshold})")


def _check_flags(candidate, self_test: bool, teacher_forced: bool, corpus, max_kl, tf_context: int,
                 tf_tokens: int) -> None:
    if self_test and candidate is not None:
        raise ValueError("--self-test compares the baseline with itself: drop --candidate")
    if self_test and teacher_forced:
        raise ValueError("--self-test and --teacher-forced are separate checks: give one of them")
    if corpus is not None and not teacher_forced:
        raise ValueError("--corpus only applies to --teacher-forced: add --teacher-forced or drop --corpus")
    if max_kl is not None and not teacher_forced:
        raise ValueError("--max-kl only applies to --teacher-forced: add --teacher-forced or drop --max-kl")
    given = [f for f, name in (("--tf-context", "tf_context"), ("--tf-tokens", "tf_tokens")) if _given(name)]
    if given and corpus is None and min(tf_context, tf_tokens) >= 1:  # (a bad count: named by its own rule)
        raise ValueError(f"{' and '.join(given)} {'size' if len(given) > 1 else 'sizes'} a teacher-forced run on a shipped text: add --corpus (bread, "
                         "lighthouses, rivers) and --teacher-forced, or drop them (over the prompt, teacher-forced "
                         "quality scores the prompt and --max-new-tokens generated tokens)")


def _given(param: str) -> bool:
    """Whether ``param`` was given on the command line (or by environment), not left at its default."""
    source = click.get_current_context().get_parameter_source(param)
    return source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT")


def _teacher_forced(engine, model, cand_pol, prompt, corpus, tf_context, tf_tokens, cache_mode, chat,
                    max_new_tokens, reports: dict, prefill_chunk: int | None = None):
    """Run, save, write and print teacher-forced quality; the engine's ``TeacherForcedReport``."""
    from tqbench.cli.render.progress import EventProgress
    from tqbench.cli.render.validate import print_teacher_forced, teacher_forced_md
    from tqbench.engine import teacher_forced_quality

    with EventProgress(enabled=not reports["as_json"], label="teacher-forced") as prog:
        rep = teacher_forced_quality(engine, [cand_pol], prompt=prompt, corpus=corpus,
                                     context_tokens=tf_context, eval_tokens=tf_tokens,
                                     cache_mode=cache_mode, chat=chat, max_new_tokens=max_new_tokens,
                                     on_event=prog, prefill_chunk=prefill_chunk)
    payload = rep.to_dict()
    save_session_if_asked(engine, model, validations=[rep])
    write_reports(payload, teacher_forced_md(rep), **reports)
    if not reports["as_json"]:
        print_teacher_forced(rep)
    return rep


def _lockstep(engine, model, text, base_pol, cand_pol, cache_mode, baseline_mode, self_test: bool, kw: dict,
              reports: dict):
    """Run, save, write and print a lockstep validation (or self-test); the engine's ``ValidationReport``."""
    from tqbench.cli.render.progress import EventProgress
    from tqbench.cli.render.validate import print_validation, validation_md
    from tqbench.engine import run_validate
    from tqbench.engine import self_test as run_self_test

    with EventProgress(enabled=not reports["as_json"], total=kw["max_new_tokens"], label="validate") as prog:
        if self_test:
            report = run_self_test(engine, text, base_pol, cache_mode=baseline_mode, on_event=prog, **kw)
        else:
            report = run_validate(engine, text, base_pol, cand_pol, cache_mode=cache_mode,
                                  baseline_mode=baseline_mode, on_event=prog, **kw)
    payload = report.to_dict()
    save_session_if_asked(engine, model, validations=[report])
    write_reports(payload, validation_md(report), **reports)
    if not reports["as_json"]:
        print_validation(report)
    return report
