"""``kv-estimate``: KV bytes, bits per element and saving for a model geometry (config only, no weights).

Heavy imports happen inside the command. Exit codes: 0 = done and the gate passed, 1 = a policy does not
fit ``--memory-budget``, 2 = bad input.
"""

from __future__ import annotations

import json

import click

from tqbench.cli.options import (
    POLICIES_HELP,
    check_out_paths,
    friendly_errors,
    gate,
    policy_list,
    policy_option,
    report_options,
    write_reports,
)


@click.command("kv-estimate")
@click.option("--model", default=None, help="Shipped config name ('default', 'gemma3-270m', see --list-models), "
              "a config.json, a model folder or a .gguf file (its config only).")
@click.option("--layers", type=int, default=None, help="Explicit geometry: number of layers.")
@click.option("--kv-heads", type=int, default=None, help="Explicit geometry: KV heads.")
@click.option("--head-dim", type=int, default=None, help="Explicit geometry: head dimension.")
@click.option("--seq-len", default="32768", show_default=True,
              help="Context length(s) in tokens; several (1024,4096,8192,32768) give a table and a chart of bytes.")
@click.option("--batch", type=int, default=1, show_default=True, help="Sequences held at once (bytes scale with it).")
@click.option("--decoded", type=click.IntRange(min=0), default=0, show_default=True,
              help="Of --seq-len, how many tokens were decoded one per call after the prompt (a bench run's "
                   "output tokens - 1); matters only to a policy with keep=, which evicts at the end of the prompt.")
@policy_option("--kv-policy", "kv_policy", multiple=True, default=("fp16,turbo4",), show_default=True,
              help="A policy (preset, compact string or file), one row each. " + POLICIES_HELP)
@click.option("--memory-budget", default=None, help="e.g. 24GiB or 80GB: longest context that fits.")
@click.option("--list-models", is_flag=True, help="List the shipped model configs.")
@report_options
@friendly_errors
def kv_estimate(model, layers, kv_heads, head_dim, seq_len, batch, decoded, kv_policy, memory_budget, list_models,
                report_json, report_md, as_json):
    """KV bytes, bits per element and saving for a model geometry (config only, no weights)."""
    if list_models:
        return _list_models(as_json)
    from tqbench.engine.request import check_estimate_args, parse_bytes

    explicit = [x is not None for x in (layers, kv_heads, head_dim)]
    if model is not None and any(explicit):
        raise ValueError("give either --model or --layers/--kv-heads/--head-dim, not both")
    if any(explicit) and not all(explicit):
        raise ValueError("an explicit geometry needs all three of --layers, --kv-heads and --head-dim")
    lengths = seq_lens(seq_len)
    for n in lengths:  # bad numbers, paths and policies: one line before torch loads
        check_estimate_args(n, batch, decoded)
    check_out_paths(report_json, report_md)
    policies = policy_list(kv_policy)
    budget = parse_bytes(memory_budget) if memory_budget is not None else None
    from tqbench.cli.render.estimate import kv_estimate_md, print_kv_estimate
    from tqbench.engine.cache import explicit_geometry
    from tqbench.engine.cache import kv_estimate as estimate_report
    from tqbench.engine.models import find_geometry

    geo = explicit_geometry(layers, kv_heads, head_dim) if all(explicit) else find_geometry(model or "default")
    reps = [estimate_report(geo, policies, n, batch, budget, decoded=decoded) for n in lengths]
    if len(reps) == 1:
        rep = reps[0]
        write_reports(rep.to_dict(), kv_estimate_md(rep), report_json, report_md, as_json)
        if not as_json:
            print_kv_estimate(rep)
    else:
        from tqbench.cli.render.estimate import kv_curve_md, print_kv_curve

        payload = {"seq_lens": lengths, "reports": [r.to_dict() for r in reps]}
        write_reports(payload, kv_curve_md(reps), report_json, report_md, as_json)
        if not as_json:
            print_kv_curve(reps)
    if budget is not None:
        for rep in reps:
            over = [r.kv_policy for r in rep.rows if r.total_bytes > budget]
            gate(not over, f"{', '.join(over)} do(es) not fit {memory_budget} at {rep.seq_len} tokens")


def seq_lens(text: str) -> list[int]:
    """``--seq-len``: one token count or several, comma-separated."""
    try:
        lengths = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        lengths = []
    if not lengths:  # a count below 1 is the engine's to refuse (one rule, the same words in every front end)
        raise ValueError(f"--seq-len {text!r} is invalid: give token counts, one or comma-separated "
                         "(e.g. 1024,4096,8192,32768)")
    return lengths


def _list_models(as_json: bool) -> None:
    from tqbench.cli.render.estimate import print_models
    from tqbench.engine.cache import model_geometry, shipped_models

    models = [model_geometry(m) for m in shipped_models()]
    if as_json:
        click.echo(json.dumps([m.to_dict() for m in models], indent=2))
    else:
        print_models(models)
