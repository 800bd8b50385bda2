"""``export``: a policy as the closest KV setting of llama.cpp, vLLM, SGLang or TensorRT-LLM, measured here.

Heavy imports happen inside the command. Exit codes: 0 = done, 2 = bad input.
"""

from __future__ import annotations

import sys

import click

from tqbench.cli.options import (
    check_out_paths,
    check_teacher_forced_flags,
    friendly_errors,
    model_options,
    policy_option,
    report_options,
    write_reports,
)
from tqbench.constants import CACHE_MODE_HELP, CACHE_MODES, DEFAULT_CACHE_MODE, DEFAULT_KLD_CHUNKS

ENGINE_CHOICES = ("llamacpp", "vllm", "sglang", "trtllm")


@click.command("export")
@policy_option("policy", argument=True)
@click.option("--to", "to", type=click.Choice(ENGINE_CHOICES), required=True, help="The engine to deploy on.")
@model_options
@click.option("--no-measure", is_flag=True, help="Only map: do not measure the original and the mapped setting.")
@click.option("--corpus", default="rivers", show_default=True, help="Shipped text the measurement runs on.")
@click.option("--tf-context", type=int, default=256, show_default=True, help="Teacher-forced prefill tokens.")
@click.option("--tf-tokens", type=int, default=64, show_default=True, help="Teacher-forced scored tokens.")
@click.option("--cache-mode", type=click.Choice([m for m in CACHE_MODES if m != "dense-shadow"]),
              default=DEFAULT_CACHE_MODE, show_default=True, help=CACHE_MODE_HELP)
@click.option("--seq-len", type=int, default=1024, show_default=True, help="Context the bits per element are at.")
@click.option("--verify", is_flag=True,
              help="llama.cpp only: run the exported flags in llama.cpp (found or built; llama-perplexity "
                   "--kl-divergence against its f16 cache) and print its KLD beside tqbench's prediction.")
@click.option("--kld-ctx", type=click.IntRange(min=64), default=1024, show_default=True,
              help="llama.cpp KLD: tokens per chunk (the text needs at least twice as many).")
@click.option("--kld-text", "kld_texts", multiple=True,
              help="llama.cpp KLD: a shipped text (corpus:NAME, heldout:A+B, ...) or a text file; repeatable "
                   "[default: corpus:rivers+bread+lighthouses and heldout:technical+code].")
@click.option("--kld-chunks", "--chunks", "kld_chunks", type=click.IntRange(min=0), default=DEFAULT_KLD_CHUNKS,
              show_default=True,
              help="llama.cpp KLD: chunks per text, as llama-perplexity --chunks (each costs two forward passes of "
                   "--kld-ctx tokens through the modelled llama.cpp path); 0 skips the prediction.")
@report_options
@friendly_errors
def export(policy, to, model, device, dtype, threads, no_measure, corpus, tf_context, tf_tokens, cache_mode,
           seq_len, verify, kld_ctx, kld_texts, kld_chunks, report_json, report_md, as_json):
    """POLICY (a preset, compact string, engine setting or saved .toml) as the closest setting ENGINE accepts:
    the flags or config lines and what could not be mapped (printed first), then (unless --no-measure)
    teacher-forced KL and bits per element of the original and the mapped setting on this model. For llama.cpp
    on a GGUF model it also predicts llama-perplexity's KLD of the flags on --kld-chunks chunks per text; --verify
    measures it in llama.cpp beside the prediction."""
    from tqbench.cli.render.console import err, load_engine
    from tqbench.cli.render.export import export_md, print_mapping, print_measured
    from tqbench.cli.render.progress import EventProgress
    from tqbench.engine.deploy import export_policy

    check_out_paths(report_json, report_md)
    if not no_measure:
        check_teacher_forced_flags(corpus, tf_context, tf_tokens)
    if verify and (to != "llamacpp" or no_measure or kld_chunks == 0):
        raise ValueError("--verify runs the exported flags in llama.cpp: use it with --to llamacpp, without "
                         "--no-measure and with --kld-chunks 1 or more")
    if kld_texts:
        from tqbench.engine.allocate.texts import resolve_texts

        for name in kld_texts:
            resolve_texts(name)
    if seq_len < 1:
        raise ValueError(f"--seq-len {seq_len} is invalid: give a whole number of tokens >= 1")
    setting = None
    if model == "default":  # the mapping needs only the geometry: print it before loading anything
        from tqbench.engine.cache import model_geometry

        geo = model_geometry("default")
        rep = export_policy(policy, to, geometry=geo.geometry, model_name=geo.name, seq_len=seq_len, measure=False)
        setting = rep.setting
        if not as_json:
            print_mapping(setting, rep.model if no_measure else geo.name)
        if no_measure:
            write_reports(rep.to_dict(), export_md(rep), report_json, report_md, as_json)
            if not as_json:
                print_measured(rep)
            return
    engine = load_engine(model, device, dtype, threads, quiet=as_json)
    if setting is None:
        setting = export_policy(policy, to, engine=engine, seq_len=seq_len, measure=False).setting
        if not as_json:
            print_mapping(setting, engine.name)
    if no_measure:
        rep = export_policy(policy, to, engine=engine, seq_len=seq_len, measure=False, setting=setting)
    else:
        import os

        from tqbench.engine.deploy.llamacpp import LlamaCppUnavailable

        kld = "off" if to != "llamacpp" or kld_chunks == 0 else "verify" if verify else "predict"
        if not as_json:
            for line in _cost_lines(engine, corpus, tf_context, tf_tokens, kld, kld_texts, kld_chunks, kld_ctx):
                err.print(line, markup=False, highlight=False, soft_wrap=True)
        with EventProgress(label="export", lines=True if as_json else None) as prog:
            try:
                rep = export_policy(policy, to, engine=engine, seq_len=seq_len, measure=True, corpus=corpus,
                                    context_tokens=tf_context, eval_tokens=tf_tokens, cache_mode=cache_mode,
                                    on_event=prog, llamacpp_kld=kld, kld_texts=kld_texts or None, kld_ctx=kld_ctx,
                                    kld_chunks=kld_chunks or None, threads=threads or os.cpu_count() or 1,
                                    progress=lambda msg: click.echo(f"llama.cpp KLD: {msg}", err=True),
                                    setting=setting)
            except LlamaCppUnavailable as exc:
                click.echo(f"error: {exc}", err=True)
                sys.exit(2)
    write_reports(rep.to_dict(), export_md(rep), report_json, report_md, as_json)
    if not as_json:
        print_measured(rep)


def _cost_lines(engine, corpus, tf_context, tf_tokens, kld, kld_texts, kld_chunks, kld_ctx) -> list[str]:
    """What the measurement will run, said before it starts."""
    lines = [f"measuring: teacher-forced on {corpus}, {tf_context} prefill + {tf_tokens} scored tokens, for the fp16 "
             f"baseline, the policy and the mapped setting (--no-measure skips all measuring)"]
    if kld == "off":
        return lines
    from tqbench.engine.deploy.llamacpp_kld import VERIFY_TEXTS
    from tqbench.engine.deploy.llamacpp_verify import kld_plan, model_gguf

    if kld == "predict" and model_gguf(engine) is None:
        return lines
    _, what = kld_plan(tuple(kld_texts or VERIFY_TEXTS), kld_chunks)
    lines.append(f"then llama.cpp's KLD predicted: {what} of {kld_ctx} tokens, about 30 s each on a busy 2-core "
                 f"CPU (--kld-chunks N changes it, --kld-chunks 0 skips it)"
                 + ("; --verify also runs them in llama.cpp" if kld == "verify" else ""))
    return lines
