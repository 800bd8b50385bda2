"""The headless validation suite's commands: validate, compare-policies, niah, scan, kv-estimate.

``add_validation_commands(main, model_options, friendly_errors)`` registers them on the CLI group (cli.py
passes its own helpers, so this module never imports cli.py). Heavy imports happen inside the commands.
Exit codes: 0 = done and the gate passed, 1 = a gate failed (named on stderr), 2 = bad input.
"""

from __future__ import annotations

import json
import os
import sys

import click

from tqbench.cli.workbench import (
    compare_fields,
    save_session_if_asked,
    scan_fields,
    validate_fields,
    workbench_command,
)

CACHE_MODES = ("dense-shadow", "simulate", "compressed", "fused")
DEFAULT_PROMPT = "Explain in a few sentences why the sky is blue."
SECOND_PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def _prompt_text(prompt: str | None, prompt_file: str | None) -> str:
    if prompt is not None and prompt_file:
        raise ValueError("give either --prompt or --prompt-file, not both")
    if prompt_file:
        if not os.path.isfile(prompt_file):
            raise ValueError(f"prompt file {prompt_file!r} does not exist: check the path given to --prompt-file")
        with open(prompt_file, encoding="utf-8") as fh:
            return fh.read()
    return prompt if prompt is not None else DEFAULT_PROMPT


def _prompt_list(prompts: tuple[str, ...], prompt_files: tuple[str, ...]) -> list[str]:
    out = list(prompts)
    for f in prompt_files:
        out.append(_prompt_text(None, f))
    return out or [DEFAULT_PROMPT, SECOND_PROMPT]


def _csv(text: str | None) -> list[str] | None:
    if text is None:
        return None
    return [p.strip() for p in text.split(",") if p.strip()]


def _policy_list(text: str) -> list[str]:
    """Comma-separated policies; a compact policy with commas goes in with ';' between policies."""
    sep = ";" if ";" in text else ","
    return [p.strip() for p in text.split(sep) if p.strip()]


def _write_reports(payload: dict, md: str | None, report_json: str | None, report_md: str | None,
                   as_json: bool) -> None:
    if report_json:
        with open(report_json, "w", encoding="utf-8") as fh:
            json.dump(payload, fh, indent=2)
    if report_md and md is not None:
        with open(report_md, "w", encoding="utf-8") as fh:
            fh.write(md)
    if as_json:
        click.echo(json.dumps(payload, indent=2))


def _check_out_path(path: str | None, flag: str) -> None:
    if path:
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            raise ValueError(f"{flag} {path!r}: folder {parent!r} does not exist; create it or pick another path")


def _gate(ok: bool, message: str) -> None:
    if not ok:
        click.echo(f"gate failed: {message}", err=True)
        sys.exit(1)


def report_options(fn):
    fn = click.option("--json", "as_json", is_flag=True, help="Print the JSON report on stdout.")(fn)
    fn = click.option("--report-md", default=None, help="Write a Markdown report to this file.")(fn)
    fn = click.option("--report-json", default=None, help="Write the JSON report to this file.")(fn)
    return fn


def add_validation_commands(main: click.Group, model_options, friendly_errors) -> None:  # noqa: C901
    @main.command()
    @workbench_command("run", validate_fields)
    @model_options
    @click.option("--baseline", default="fp16", show_default=True, help="Baseline policy.")
    @click.option("--candidate", default=None, help="Candidate policy (default turbo4).")
    @click.option("--cache-mode", type=click.Choice(CACHE_MODES), default="compressed", show_default=True,
                  help="Candidate mode; dense-shadow reads exact K/V (storage-only report).")
    @click.option("--baseline-mode", type=click.Choice(CACHE_MODES), default="compressed", show_default=True)
    @click.option("--prompt", default=None, help="Prompt text.")
    @click.option("--prompt-file", default=None, help="Read the prompt from a file.")
    @click.option("--chat/--no-chat", default=True, show_default=True)
    @click.option("--max-new-tokens", type=int, default=64, show_default=True)
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
    @report_options
    @friendly_errors
    def validate(model, device, dtype, threads, baseline, candidate, cache_mode, baseline_mode, prompt,
                 prompt_file, chat, max_new_tokens, quality_threshold, collect_logits, no_per_step, self_test,
                 teacher_forced, corpus, tf_context, tf_tokens, max_kl, temperature, seed, report_json,
                 report_md, as_json):
        """Does a candidate policy change what the model says? Verdict, metrics and a recommendation."""
        from tqbench.cli.render import tables as render
        from tqbench.cli.render import validate as rv
        from tqbench.engine.generate import Sampling
        from tqbench.engine.policy.spec import parse_policy
        from tqbench.engine.validate.validation import check_generation_args

        if self_test and candidate is not None:
            raise ValueError("--self-test compares the baseline with itself: drop --candidate")
        if self_test and teacher_forced:
            raise ValueError("--self-test and --teacher-forced are separate checks: give one of them")
        if corpus is not None and not teacher_forced:
            raise ValueError("--corpus only applies to --teacher-forced: add --teacher-forced or drop --corpus")
        if max_kl is not None and not teacher_forced:
            raise ValueError("--max-kl only applies to --teacher-forced: add --teacher-forced or drop --max-kl")
        check_generation_args(max_new_tokens, quality_threshold)
        candidate = candidate or "turbo4"
        base_pol, cand_pol = parse_policy(baseline), parse_policy(candidate)
        text = _prompt_text(prompt, prompt_file)
        sampling = Sampling(temperature=temperature, seed=seed)
        _check_out_path(report_json, "--report-json")
        _check_out_path(report_md, "--report-md")
        engine = render.load_engine(model, device, dtype, threads, quiet=as_json)
        if teacher_forced:
            from tqbench.engine.validate.validation import teacher_forced_quality

            with rv.EventProgress(enabled=not as_json, label="teacher-forced") as prog:
                rep = teacher_forced_quality(engine, [cand_pol], prompt=None if corpus else text, corpus=corpus,
                                             context_tokens=tf_context, eval_tokens=tf_tokens,
                                             cache_mode=cache_mode, chat=chat, max_new_tokens=max_new_tokens,
                                             on_event=prog)
            payload = rep.to_dict()
            save_session_if_asked(engine, model, validations=[payload])
            _write_reports(payload, rv.teacher_forced_md(payload), report_json, report_md, as_json)
            if not as_json:
                rv.print_teacher_forced(payload)
            if max_kl is not None:
                worst = max(r["kl_mean"] for r in payload["results"])
                _gate(worst <= max_kl, f"teacher-forced mean KL {worst:.5f} is above --max-kl {max_kl}")
            return
        from tqbench.engine.validate.validation import self_test as run_self_test
        from tqbench.engine.validate.validation import validate as run_validate

        kw = dict(chat=chat, max_new_tokens=max_new_tokens, sampling=sampling, collect_logits=collect_logits,
                  per_step=not no_per_step, quality_threshold=quality_threshold)
        with rv.EventProgress(enabled=not as_json, total=max_new_tokens, label="validate") as prog:
            if self_test:
                report = run_self_test(engine, text, base_pol, cache_mode=baseline_mode, on_event=prog, **kw)
            else:
                report = run_validate(engine, text, base_pol, cand_pol, cache_mode=cache_mode,
                                      baseline_mode=baseline_mode, on_event=prog, **kw)
        payload = report.to_dict()
        save_session_if_asked(engine, model, validations=[payload])
        _write_reports(payload, rv.validation_md(payload), report_json, report_md, as_json)
        if not as_json:
            rv.print_validation(payload)
        if self_test:
            _gate(report.passed, f"self-test verdict is {report.quality_verdict}, not exact-match: the loop is "
                  "not deterministic")
        elif report.storage_only:
            click.echo("note: dense-shadow is storage-only: no quality verdict is claimed", err=True)
        else:
            _gate(report.passed, f"verdict {report.quality_verdict} (needs exact-match or near-stable at "
                  f"--quality-threshold {quality_threshold})")

    @main.command("compare-policies")
    @workbench_command("compare", compare_fields)
    @model_options
    @click.option("--policies", default=None, help="Comma-separated policies (';' between compact policies); "
                  "default: every preset.")
    @click.option("--baseline", default="fp16", show_default=True)
    @click.option("--cache-mode", type=click.Choice(CACHE_MODES), default="compressed", show_default=True)
    @click.option("--prompt", "prompts", multiple=True, help="A prompt (repeatable). Default: two built-in prompts.")
    @click.option("--prompt-file", "prompt_files", multiple=True, help="A prompt file (repeatable).")
    @click.option("--chat/--no-chat", default=True, show_default=True)
    @click.option("--max-new-tokens", type=int, default=48, show_default=True)
    @click.option("--quality-threshold", type=float, default=0.9, show_default=True)
    @click.option("--summary-only", is_flag=True, help="Print only the recommendation.")
    @click.option("--require-exact", is_flag=True,
                  help="Gate: exit 1 when no compressed policy is exact-match on every prompt.")
    @report_options
    @friendly_errors
    def compare_policies(model, device, dtype, threads, policies, baseline, cache_mode, prompts, prompt_files, chat,
                         max_new_tokens, quality_threshold, summary_only, require_exact, report_json, report_md,
                         as_json):
        """Several candidate policies against one baseline: a matrix and a recommendation."""
        from tqbench.cli.render import tables as render
        from tqbench.cli.render import validate as rv
        from tqbench.engine.policy.spec import parse_policy
        from tqbench.engine.validate.compare import compare_policies as run_compare
        from tqbench.engine.validate.compare import default_policies
        from tqbench.engine.validate.validation import check_generation_args

        check_generation_args(max_new_tokens, quality_threshold)
        base = parse_policy(baseline)
        names = _policy_list(policies) if policies is not None else default_policies(base.label)
        for n in names:
            parse_policy(n)
        texts = _prompt_list(prompts, prompt_files)
        _check_out_path(report_json, "--report-json")
        _check_out_path(report_md, "--report-md")
        engine = render.load_engine(model, device, dtype, threads, quiet=as_json)
        total = len(texts) * (len(names) + 1)
        with rv.EventProgress(enabled=not as_json, total=total, label="compare") as prog:
            res = run_compare(engine, names, texts, baseline=base, cache_mode=cache_mode,
                              max_new_tokens=max_new_tokens, chat=chat, quality_threshold=quality_threshold,
                              on_event=prog)
        payload = res.to_dict()
        payload["threads"] = _threads()
        save_session_if_asked(engine, model, compares=[payload])
        _write_reports(payload, rv.compare_md(payload), report_json, report_md, as_json)
        if not as_json:
            rv.print_compare(payload, summary_only=summary_only)
        if require_exact:
            _gate(payload["recommendation"]["status"] == "compressed-policy",
                  "no compressed policy was exact-match on every prompt")

    @main.command()
    @model_options
    @click.option("--policies", default="turbo4,turbo2", show_default=True,
                  help="Candidate policies (';' between compact policies).")
    @click.option("--baseline", default="fp16", show_default=True)
    @click.option("--cache-mode", type=click.Choice(CACHE_MODES), default="compressed", show_default=True)
    @click.option("--lengths", default="256,512,1024", show_default=True, help="Haystack lengths in tokens.")
    @click.option("--depths", default="0.1,0.5,0.9", show_default=True, help="Needle depths (0 = start, 1 = end).")
    @click.option("--max-context", type=int, default=None, help="Refuse lengths above this (default: the model's).")
    @click.option("--max-new-tokens", type=int, default=24, show_default=True)
    @click.option("--chat/--no-chat", default=True, show_default=True)
    @click.option("--seed", type=int, default=0, show_default=True, help="Passphrase seed.")
    @report_options
    @friendly_errors
    def niah(model, device, dtype, threads, policies, baseline, cache_mode, lengths, depths, max_context,
             max_new_tokens, chat, seed, report_json, report_md, as_json):
        """Needle in a haystack: recall of a hidden passphrase, baseline vs each policy, per length x depth."""
        from tqbench.cli.render import tables as render
        from tqbench.cli.render import validate as rv
        from tqbench.engine.policy.spec import parse_policy
        from tqbench.engine.validate.niah import needle_in_haystack

        lens = _ints(lengths, "--lengths")
        deps = _floats(depths, "--depths")
        names = _policy_list(policies)
        base = parse_policy(baseline)
        for n in names:
            if parse_policy(n).label == base.label:
                raise ValueError(f"policy {n!r} is the baseline: list only candidates in --policies")
        if max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens {max_new_tokens} is invalid: ask for at least 1 token")
        _check_out_path(report_json, "--report-json")
        _check_out_path(report_md, "--report-md")
        engine = render.load_engine(model, device, dtype, threads, quiet=as_json)
        total = len(lens) * len(deps) * (len(names) + 1)
        with rv.EventProgress(enabled=not as_json, total=total, label="niah") as prog:
            res = needle_in_haystack(engine, names, lens, deps, baseline=base, cache_mode=cache_mode, chat=chat,
                                     max_new_tokens=max_new_tokens, max_context=max_context, seed=seed,
                                     on_event=prog)
        payload = res.to_dict()
        _write_reports(payload, rv.niah_md(payload), report_json, report_md, as_json)
        if not as_json:
            rv.print_niah(payload)
        base_recall = payload["summary"][0]["recall"]
        worse = [r["policy"] for r in payload["summary"][1:] if r["recall"] < base_recall]
        _gate(not worse, f"recall below the baseline's ({base_recall:.2f}) for {', '.join(worse)}")

    @main.command()
    @workbench_command("scan", scan_fields)
    @model_options
    @click.option("--prompt", default=None, help="Prompt text.")
    @click.option("--prompt-file", default=None, help="Read the prompt from a file.")
    @click.option("--chat/--no-chat", default=True, show_default=True)
    @click.option("--layers", default=None, help="Layers to scan: 0,3,-1 or first2+last2 (default: all).")
    @click.option("--max-prompt-tokens", type=int, default=512, show_default=True)
    @click.option("--generated-tokens", type=int, default=0, show_default=True,
                  help="Also capture this many greedily generated tokens.")
    @click.option("--codecs", default=None, help="Comma-separated codecs (default int8,int4,turbo4..turbo2).")
    @click.option("--preset", default=None, help="Codec preset: safe, aggressive or all.")
    @click.option("--thresholds", default=None,
                  help="Pass limits, e.g. kl=0.02,out=0.15 (metrics: softmax_kl, attn_out_rel_err, "
                  "score_rel_err, score_cosine (min), k_rel_mse, v_rel_mse).")
    @click.option("--summary-table", is_flag=True, help="Print only the per-layer summary table.")
    @click.option("--fail-on-sensitive", is_flag=True,
                  help="Gate: exit 1 when some layer has no codec meeting the thresholds.")
    @report_options
    @friendly_errors
    def scan(model, device, dtype, threads, prompt, prompt_file, chat, layers, max_prompt_tokens, generated_tokens,
             codecs, preset, thresholds, summary_table, fail_on_sensitive, report_json, report_md, as_json):
        """Capture real Q/K/V and measure each codec per layer and KV head; suggest a per-layer policy."""
        from tqbench.cli.render import tables as render
        from tqbench.cli.render import validate as rv
        from tqbench.engine.scan.scan_run import parse_thresholds, resolve_codecs
        from tqbench.engine.scan.scan_run import scan as run_scan

        text = _prompt_text(prompt, prompt_file)
        codec_list = resolve_codecs(_csv(codecs), preset)
        limits = parse_thresholds(thresholds)
        if max_prompt_tokens < 1:
            raise ValueError(f"--max-prompt-tokens {max_prompt_tokens} is invalid: use at least 1")
        if generated_tokens < 0:
            raise ValueError(f"--generated-tokens {generated_tokens} is invalid: use 0 or more")
        _check_out_path(report_json, "--report-json")
        _check_out_path(report_md, "--report-md")
        engine = render.load_engine(model, device, dtype, threads, quiet=as_json)
        with rv.EventProgress(enabled=not as_json, label="scan") as prog:
            res = run_scan(engine, text, layers=layers, codecs=codec_list, thresholds=limits,
                           max_prompt_tokens=max_prompt_tokens, generated_tokens=generated_tokens, chat=chat,
                           on_event=prog)
        payload = res.to_dict()
        save_session_if_asked(engine, model, scans=[payload])
        _write_reports(payload, rv.scan_md(payload), report_json, report_md, as_json)
        if not as_json:
            rv.print_scan(payload, summary_only=summary_table)
        if fail_on_sensitive:
            bad = [v["layer"] for v in payload["verdicts"] if v["cheapest"] is None]
            _gate(not bad, f"no codec met the thresholds on layers {bad}")

    @main.command("kv-estimate")
    @click.option("--model", default=None, help="Shipped config name, 'default', a config.json or a model folder.")
    @click.option("--layers", type=int, default=None, help="Explicit geometry: number of layers.")
    @click.option("--kv-heads", type=int, default=None, help="Explicit geometry: KV heads.")
    @click.option("--head-dim", type=int, default=None, help="Explicit geometry: head dimension.")
    @click.option("--seq-len", type=int, default=32768, show_default=True)
    @click.option("--batch", type=int, default=1, show_default=True)
    @click.option("--kv-policy", "kv_policy", default="fp16,turbo4", show_default=True,
                  help="One or several policies (';' between compact policies).")
    @click.option("--memory-budget", default=None, help="e.g. 24GiB or 80GB: longest context that fits.")
    @click.option("--list-models", is_flag=True, help="List the shipped model configs.")
    @report_options
    @friendly_errors
    def kv_estimate(model, layers, kv_heads, head_dim, seq_len, batch, kv_policy, memory_budget, list_models,
                    report_json, report_md, as_json):
        """KV bytes, bits per element and saving for a model geometry (config only, no weights)."""
        from tqbench.cli.render import validate as rv
        from tqbench.engine.cache import kv_estimate as ke

        if list_models:
            rows = [ke.model_geometry(m).to_dict() for m in ke.shipped_models()]
            if as_json:
                click.echo(json.dumps(rows, indent=2))
            else:
                rv.print_models(rows)
            return
        explicit = [x is not None for x in (layers, kv_heads, head_dim)]
        if model is not None and any(explicit):
            raise ValueError("give either --model or --layers/--kv-heads/--head-dim, not both")
        if any(explicit) and not all(explicit):
            raise ValueError("an explicit geometry needs all three of --layers, --kv-heads and --head-dim")
        geo = ke.explicit_geometry(layers, kv_heads, head_dim) if all(explicit) else ke.model_geometry(model or "default")
        budget = ke.parse_bytes(memory_budget) if memory_budget is not None else None
        _check_out_path(report_json, "--report-json")
        _check_out_path(report_md, "--report-md")
        rep = ke.kv_estimate(geo, _policy_list(kv_policy), seq_len, batch, budget)
        payload = rep.to_dict()
        _write_reports(payload, rv.kv_estimate_md(payload), report_json, report_md, as_json)
        if not as_json:
            rv.print_kv_estimate(payload)
        if budget is not None:
            over = [r["kv_policy"] for r in payload["rows"] if r["total_bytes"] > budget]
            _gate(not over, f"{', '.join(over)} do(es) not fit {memory_budget} at {seq_len} tokens")


def _ints(text: str, flag: str) -> list[int]:
    try:
        vals = [int(x) for x in _csv(text) or []]
    except ValueError:
        raise ValueError(f"{flag} {text!r} is invalid: give whole numbers like 256,512") from None
    if not vals or any(v < 1 for v in vals):
        raise ValueError(f"{flag} {text!r} is invalid: give whole numbers >= 1 like 256,512")
    return vals


def _floats(text: str, flag: str) -> list[float]:
    try:
        vals = [float(x) for x in _csv(text) or []]
    except ValueError:
        raise ValueError(f"{flag} {text!r} is invalid: give fractions like 0.1,0.5,0.9") from None
    if not vals or any(not 0 <= v <= 1 for v in vals):
        raise ValueError(f"{flag} {text!r} is invalid: give fractions between 0 and 1 like 0.1,0.5,0.9")
    return vals


def _threads() -> int:
    import torch

    return torch.get_num_threads()
