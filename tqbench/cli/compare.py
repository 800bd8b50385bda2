"""The many-policy commands: ``compare-policies`` (several candidates against one baseline: a matrix and a
recommendation) and ``niah`` (needle-in-a-haystack recall, baseline vs each policy).

Heavy imports happen inside the commands. Exit codes: 0 = done and the gate passed, 1 = a gate failed
(named on stderr), 2 = bad input.
"""

from __future__ import annotations

import click

from tqbench.cli.options import (
    POLICIES_HELP,
    check_out_paths,
    floats,
    friendly_errors,
    gate,
    ints,
    model_options,
    policy_list,
    policy_option,
    prompt_list,
    report_options,
    torch_threads,
    write_reports,
)
from tqbench.cli.workbench import compare_fields, save_session_if_asked, workbench_command
from tqbench.constants import CACHE_MODE_HELP, CACHE_MODES, DEFAULT_CACHE_MODE


@click.command("compare-policies")
@workbench_command("compare", compare_fields)
@model_options
@policy_option("--policies", multiple=True, help="Candidate policies (default: every preset). " + POLICIES_HELP)
@policy_option("--baseline", default="fp16", show_default=True, help="The reference policy (or dense cache).")
@click.option("--cache-mode", type=click.Choice(CACHE_MODES), default=DEFAULT_CACHE_MODE, show_default=True,
              help=CACHE_MODE_HELP)
@click.option("--prompt", "prompts", multiple=True, help="A prompt (repeatable). Default: two built-in prompts.")
@click.option("--prompt-file", "prompt_files", multiple=True, help="A prompt file (repeatable).")
@click.option("--chat/--no-chat", default=True, show_default=True, help="Wrap the prompt in the chat template.")
@click.option("--max-new-tokens", type=int, default=48, show_default=True, help="Tokens generated per prompt.")
@click.option("--quality-threshold", type=float, default=0.9, show_default=True,
              help="Token match ratio a policy needs to count as near-stable.")
@click.option("--summary-only", is_flag=True, help="Print only the recommendation.")
@click.option("--require-exact", is_flag=True,
              help="Gate: exit 1 when no compressed policy is exact-match on every prompt.")
@report_options
@friendly_errors
def compare_policies(model, device, dtype, threads, policies, baseline, cache_mode, prompts, prompt_files, chat,
                     max_new_tokens, quality_threshold, summary_only, require_exact, report_json, report_md,
                     as_json):
    """Several candidate policies against one baseline: a matrix and a recommendation."""
    check_out_paths(report_json, report_md)  # paths (and the policies, at the door) before torch loads
    texts = prompt_list(prompts, prompt_files)
    from tqbench.cli.render.compare import compare_md, print_compare
    from tqbench.cli.render.console import load_engine, warn_policies
    from tqbench.cli.render.progress import EventProgress
    from tqbench.engine import compare_policies as run_compare
    from tqbench.engine import parse_policy
    from tqbench.engine.validate import check_generation_args, default_policies

    check_generation_args(max_new_tokens, quality_threshold)
    base = parse_policy(baseline)
    names = policy_list(policies) if policies else default_policies(base.label)
    for n in names:
        parse_policy(n)
    engine = load_engine(model, device, dtype, threads, quiet=as_json)
    warn_policies(engine, base, *names)
    total = len(texts) * (len(names) + 1)
    with EventProgress(enabled=not as_json, total=total, label="compare") as prog:
        res = run_compare(engine, names, texts, baseline=base, cache_mode=cache_mode,
                          max_new_tokens=max_new_tokens, chat=chat, quality_threshold=quality_threshold,
                          on_event=prog)
    res.threads = torch_threads()
    payload = res.to_dict()
    save_session_if_asked(engine, model, compares=[res])
    write_reports(payload, compare_md(res), report_json, report_md, as_json)
    if not as_json:
        print_compare(res, summary_only=summary_only)
    if require_exact:
        gate(res.recommendation["status"] == "compressed-policy",
             "no compressed policy was exact-match on every prompt")


@click.command()
@model_options
@policy_option("--policies", multiple=True, default=("turbo4,turbo2",), show_default=True,
              help="Candidate policies. " + POLICIES_HELP)
@policy_option("--baseline", default="fp16", show_default=True, help="The reference policy (or dense cache).")
@click.option("--cache-mode", type=click.Choice(CACHE_MODES), default=DEFAULT_CACHE_MODE, show_default=True,
              help=CACHE_MODE_HELP)
@click.option("--lengths", default="256,512,1024", show_default=True, help="Haystack lengths in tokens.")
@click.option("--depths", default="0.1,0.5,0.9", show_default=True, help="Needle depths (0 = start, 1 = end).")
@click.option("--max-context", type=int, default=None, help="Refuse lengths above this (default: the model's).")
@click.option("--max-new-tokens", type=int, default=24, show_default=True, help="Tokens generated per answer.")
@click.option("--chat/--no-chat", default=True, show_default=True, help="Wrap the prompt in the chat template.")
@click.option("--seed", type=int, default=0, show_default=True, help="Passphrase seed.")
@report_options
@friendly_errors
def niah(model, device, dtype, threads, policies, baseline, cache_mode, lengths, depths, max_context,
         max_new_tokens, chat, seed, report_json, report_md, as_json):
    """Needle in a haystack: recall of a hidden passphrase, baseline vs each policy, per length x depth."""
    from tqbench.engine import check_max_new_tokens, parse_policy

    lens = ints(lengths, "--lengths")
    deps = floats(depths, "--depths")
    names = policy_list(policies)
    base = parse_policy(baseline)
    for n in names:
        if parse_policy(n).label == base.label:
            raise ValueError(f"policy {n!r} is the baseline: list only candidates in --policies")
    check_max_new_tokens(max_new_tokens)
    check_out_paths(report_json, report_md)  # the torch-free checks first: one line in well under a second
    from tqbench.cli.render.compare import niah_md, print_niah
    from tqbench.cli.render.console import load_engine
    from tqbench.cli.render.progress import EventProgress
    from tqbench.engine import needle_in_haystack

    engine = load_engine(model, device, dtype, threads, quiet=as_json)
    total = len(lens) * len(deps) * (len(names) + 1)
    with EventProgress(enabled=not as_json, total=total, label="niah") as prog:
        res = needle_in_haystack(engine, names, lens, deps, baseline=base, cache_mode=cache_mode, chat=chat,
                                 max_new_tokens=max_new_tokens, max_context=max_context, seed=seed,
                                 on_event=prog)
    write_reports(res.to_dict(), niah_md(res), report_json, report_md, as_json)
    if not as_json:
        print_niah(res)
    summary = res.summary()
    base_recall = summary[0]["recall"]
    worse = [r["policy"] for r in summary[1:] if r["recall"] < base_recall]
    gate(not worse, f"recall below the baseline's ({base_recall:.2f}) for {', '.join(worse)}")
