"""``calibrate``: fit the calibrated key transforms (``pcaq`` codecs) of a model on calibration texts.

Writes one safetensors file (tensors + the model's name and fingerprint); a policy uses it with
``calib=FILE`` (``k=pcaq2.5,v=turbo2.5,calib=FILE``). Without ``calib=`` policies use the fit shipped for the
default model, and refuse on any other model.
"""

from __future__ import annotations

import json

import click

from tqbench.cli.options import check_out_path, csv, friendly_errors, model_options


@click.command()
@model_options
@click.option("--texts", default="prose,code,legal,chat", show_default=True,
              help="Calibration texts: names of the shipped mix (prose, code, legal, chat) or text file paths.")
@click.option("--max-tokens", type=click.IntRange(min=16), default=1024, show_default=True,
              help="Tokens captured per text.")
@click.option("--out", "out_path", required=True, help="The transforms file to write (.safetensors).")
@click.option("--json", "as_json", is_flag=True, help="Print what was fitted as JSON.")
@friendly_errors
def calibrate(model, device, dtype, threads, texts, max_tokens, out_path, as_json):
    """Fit per-(layer, KV head) key transforms (PCA in the queries' metric) for the pcaq codecs."""
    from tqbench.cli.render.console import load_engine
    from tqbench.cli.render.progress import EventProgress
    from tqbench.engine.calibrate import fit_transforms
    from tqbench.engine.codecs.transforms_file import save_transforms

    check_out_path(out_path, "--out", ".safetensors")
    engine = load_engine(model, device, dtype, threads, quiet=as_json)
    with EventProgress(enabled=not as_json, label="calibrate") as prog:
        tr = fit_transforms(engine, csv(texts), max_tokens=max_tokens, on_event=prog)
    save_transforms(tr, out_path)
    info = tr.to_dict()
    if as_json:
        click.echo(json.dumps(info, indent=2))
    else:
        click.echo(f"fitted {tr.num_layers} layers x {tr.kv_heads} KV heads (head_dim {tr.head_dim}) of {tr.model} "
                   f"(fingerprint {tr.fingerprint}) on {', '.join(t['text'] for t in tr.calibration)}: wrote "
                   f"{out_path} ({info['bytes']} bytes); use it with k=pcaq2.5,v=turbo2.5,calib={out_path}")
