"""``scan``: capture real Q/K/V and measure each codec per layer and KV head; suggest a per-layer policy.

Heavy imports happen inside the command. Exit codes: 0 = done and the gate passed, 1 = a gate failed
(named on stderr), 2 = bad input.
"""

from __future__ import annotations

import click

from tqbench.cli.options import (
    check_out_paths,
    csv,
    friendly_errors,
    gate,
    model_options,
    prompt_text,
    report_options,
    write_reports,
)
from tqbench.cli.workbench import save_session_if_asked, scan_fields, workbench_command


@click.command()
@workbench_command("scan", scan_fields)
@model_options
@click.option("--prompt", default=None, help="Prompt text.")
@click.option("--prompt-file", default=None, help="Read the prompt from a file.")
@click.option("--chat/--no-chat", default=True, show_default=True, help="Wrap the prompt in the chat template.")
@click.option("--layers", default=None, help="Layers to scan: 0,3,-1 or first2+last2 (default: all).")
@click.option("--max-prompt-tokens", type=int, default=512, show_default=True,
              help="The prompt is cut to this many tokens before Q/K/V are captured.")
@click.option("--generated-tokens", type=int, default=0, show_default=True,
              help="Also capture this many greedily generated tokens.")
@click.option("--codecs", default=None, help="Comma-separated codecs (default int8,int4,turbo4..turbo2, plus the calibrated key codecs "
              "pcaq4..pcaq2 when the model has a shipped fit).")
@click.option("--preset", default=None, help="Codec preset: safe, aggressive or all.")
@click.option("--thresholds", default=None,
              help="Pass limits, e.g. kl=0.02,out=0.15 (metrics: softmax_kl, attn_out_rel_err, "
              "score_rel_err, score_cosine (min), k_rel_mse, v_rel_mse).")
@click.option("--calib", default="", help="Transforms file of the calibrated key codecs (pcaq...; default: the "
              "shipped SmolLM2-135M-Instruct fit). Fit one with `tqbench --headless calibrate`.")
@click.option("--summary-table", is_flag=True, help="Print only the per-layer summary table.")
@click.option("--fail-on-sensitive", is_flag=True,
              help="Gate: exit 1 when some layer has no codec meeting the thresholds.")
@report_options
@friendly_errors
def scan(model, device, dtype, threads, prompt, prompt_file, chat, layers, max_prompt_tokens, generated_tokens,
         codecs, preset, thresholds, calib, summary_table, fail_on_sensitive, report_json, report_md, as_json):
    """Capture real Q/K/V and measure each codec per layer and KV head; suggest a per-layer policy."""
    text = prompt_text(prompt, prompt_file)  # the torch-free checks first: one line in well under a second
    if max_prompt_tokens < 1:
        raise ValueError(f"--max-prompt-tokens {max_prompt_tokens} is invalid: use at least 1")
    if generated_tokens < 0:
        raise ValueError(f"--generated-tokens {generated_tokens} is invalid: use 0 or more")
    check_out_paths(report_json, report_md)
    from tqbench.cli.render.console import load_engine
    from tqbench.cli.render.progress import EventProgress
    from tqbench.cli.render.scan import print_scan, scan_md
    from tqbench.engine import run_scan
    from tqbench.engine.scan import parse_thresholds, resolve_codecs

    # no --codecs/--preset: the engine's default list (with the calibrated key codecs when this model has a fit)
    codec_list = resolve_codecs(csv(codecs), preset) if (codecs or preset) else None
    limits = parse_thresholds(thresholds)
    engine = load_engine(model, device, dtype, threads, quiet=as_json)
    if layers is not None:  # a bad index is refused before the job's progress starts
        from tqbench.engine.scan.capture import resolve_layers

        resolve_layers(layers, engine.geometry.num_layers)
    with EventProgress(enabled=not as_json, label="scan") as prog:
        res = run_scan(engine, text, layers=layers, codecs=codec_list, thresholds=limits,
                       max_prompt_tokens=max_prompt_tokens, generated_tokens=generated_tokens, chat=chat,
                       calib=calib, on_event=prog)
    payload = res.to_dict()
    save_session_if_asked(engine, model, scans=[res])
    write_reports(payload, scan_md(res), report_json, report_md, as_json)
    if not as_json:
        print_scan(res, summary_only=summary_table)
    if fail_on_sensitive:
        bad = [v["layer"] for v in res.verdicts if v["cheapest"] is None]
        gate(not bad, f"no codec met the thresholds on layers {bad}")
