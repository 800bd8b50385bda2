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
from tqbench.constants import CACHE_MODES

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
              default="compressed", show_default=True)
@click.option("--seq-len", type=int, default=1024, show_default=True, help="Context the bits per element are at.")
@click.option("--verify", is_flag=True,
              help="llama.cpp only: run the exported flags in llama.cpp (found or built; llama-perplexity "
                   "--kl-divergence against its f16 cache) and print its KLD beside tqbench's prediction.")
@click.option("--kld-ctx", type=click.IntRange(min=64), default=1024, show_default=True,
              help="llama.cpp KLD: tokens per chunk (the text needs at least twice as many).")
@click.option("--kld-text", "kld_texts", multiple=True,
              help="llama.cpp KLD: a shipped text (corpus:NAME, heldout:A+B, ...) or a text file; repeatable "
                   "[default: corpus:rivers+bread+lighthouses and heldout:technical+code].")
@report_options
@friendly_errors
def export(policy, to, model, device, dtype, threads, no_measure, corpus, tf_context, tf_tokens, cache_mode,
           seq_len, verify, kld_ctx, kld_texts, report_json, report_md, as_json):
    """POLICY (a preset, compact string, engine setting or saved .toml) as the closest setting ENGINE accepts:
    the flags or config lines, what could not be mapped, and (unless --no-measure) teacher-forced KL and bits
    per element of the original and the mapped setting on this model. For llama.cpp on a GGUF model it also
    predicts llama-perplexity's KLD of the flags; --verify measures it in llama.cpp beside the prediction."""
    from tqbench.cli.render.console import load_engine
    from tqbench.cli.render.export import export_md, print_export
    from tqbench.cli.render.progress import EventProgress
    from tqbench.engine.deploy import export_policy

    check_out_paths(report_json, report_md)
    if not no_measure:
        check_teacher_forced_flags(corpus, tf_context, tf_tokens)
    if verify and (to != "llamacpp" or no_measure):
        raise ValueError("--verify runs the exported flags in llama.cpp: use it with --to llamacpp and without "
                         "--no-measure")
    if kld_texts:
        from tqbench.engine.allocate.texts import resolve_texts

        for name in kld_texts:
            resolve_texts(name)
    if seq_len < 1:
        raise ValueError(f"--seq-len {seq_len} is invalid: give a whole number of tokens >= 1")
    if no_measure and model == "default":
        from tqbench.engine.cache import model_geometry

        geo = model_geometry("default")
        rep = export_policy(policy, to, geometry=geo.geometry, model_name=geo.name, seq_len=seq_len, measure=False)
    else:
        engine = load_engine(model, device, dtype, threads, quiet=as_json)
        import os

        from tqbench.engine.deploy.llamacpp import LlamaCppUnavailable

        with EventProgress(enabled=not as_json and not no_measure, label="teacher-forced") as prog:
            try:
                rep = export_policy(policy, to, engine=engine, seq_len=seq_len, measure=not no_measure, corpus=corpus,
                                    context_tokens=tf_context, eval_tokens=tf_tokens, cache_mode=cache_mode,
                                    on_event=prog, llamacpp_kld="verify" if verify else "predict",
                                    kld_texts=kld_texts or None, kld_ctx=kld_ctx,
                                    threads=threads or os.cpu_count() or 1,
                                    progress=lambda msg: click.echo(f"llama.cpp KLD: {msg}", err=True))
            except LlamaCppUnavailable as exc:
                click.echo(f"error: {exc}", err=True)
                sys.exit(2)
    write_reports(rep.to_dict(), export_md(rep), report_json, report_md, as_json)
    if not as_json:
        print_export(rep)
