"""llama.cpp's KV cache types: KLD measured in llama.cpp beside tqbench's prediction, every GGML type, two texts.

For each text: ``llama-perplexity -m GGUF -f TEXT -c CTX -fa on`` with the f16 cache writes the baseline, then
``--kl-divergence -ctk T -ctv T`` for every type; tqbench predicts the same (``deploy.llamacpp_kld``) on the
tokens llama.cpp wrote, once with the full model of llama.cpp's compute path and once per ablation (which
part of the model accounts for how much of the KLD):

- ``full``: cache storage + query conversion + every query reading the stored cache + quantized activations;
- ``no-act``: the same with fp32 activations (no ``llamacpp_matmul``), for ``--ablation-types``.

    python benchmarks/llamacpp_kld.py                          # the docs table (builds llama.cpp if needed)
    python benchmarks/llamacpp_kld.py --types q8_0,q4_0 --texts corpus:rivers+bread+lighthouses
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from _common import cpu_model, write_json
from rich.console import Console
from rich.table import Table

from tqbench.engine.deploy.llamacpp import build_llamacpp
from tqbench.engine.deploy.llamacpp_kld import (
    PROTOCOL_DIFFERENCES,
    VERIFY_TEXTS,
    measure_llamacpp_kld,
    predict_llamacpp_kld,
    read_kld_base,
    verify_text,
    with_bos,
)
from tqbench.engine.deploy.llamacpp_verify import model_gguf
from tqbench.engine.engine import Engine

TYPES = ("q8_0", "q5_1", "q5_0", "q4_1", "q4_0", "iq4_nl")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--texts", default=",".join(VERIFY_TEXTS))
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ablation-types", default="q8_0,q4_0",
                    help="Types also predicted with fp32 activations ('' for none).")
    ap.add_argument("--out", default="benchmarks/results/llamacpp-kld.json")
    args = ap.parse_args()
    con = Console()
    torch.set_num_threads(args.threads)
    types = [t.strip() for t in args.types.split(",") if t.strip()]
    settings = [(t, t) for t in types]
    build = build_llamacpp(lambda m: con.print(f"llama.cpp: {m}", markup=False), tools=("llama-perplexity",))
    engine = Engine.load("default")
    gguf = model_gguf(engine)
    if gguf is None:
        sys.exit("the default model was not loaded from its GGUF file")
    rows, t0 = [], time.time()
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="tqbench-kld-") as tmp:
        for name in [t for t in args.texts.split(",") if t]:
            text = verify_text(name, Path(tmp))
            base, measured = measure_llamacpp_kld(build.tool("llama-perplexity"), gguf, text, settings,
                                                  n_ctx=args.ctx, threads=args.threads, workdir=Path(tmp),
                                                  progress=lambda m: con.print(m, markup=False))
            tokens = with_bos(read_kld_base(base)[2], engine.tokenizer.bos_token_id)
            con.print(f"{name}: {tokens.shape[0]} chunks of {tokens.shape[1]} tokens; predicting", markup=False)
            full = predict_llamacpp_kld(engine, tokens, settings, gguf=gguf)
            abl = [s for s in settings if s[0] in args.ablation_types.split(",")]
            noact = {r.k: r for r in predict_llamacpp_kld(engine, tokens, abl, gguf=None)} if abl else {}
            for m, p in zip(measured, full):
                na = noact.get(m.k)
                rows.append({"text": name, "type": m.k, "measured": m.to_dict(), "predicted": p.to_dict(),
                             "predicted_no_act": na.to_dict() if na else None,
                             "ratio": p.kld_mean / m.kld_mean,
                             "ratio_no_act": na.kld_mean / m.kld_mean if na else None})
    table = Table(title=f"llama-perplexity KLD vs the f16 cache, -c {args.ctx}, -fa on, {args.threads} threads "
                        f"({cpu_model()})")
    for col in ("text", "-ctk/-ctv", "llama.cpp KLD", "tqbench predicted", "pred/meas", "no-act pred/meas",
                "same top % meas/pred", "PPL ratio meas/pred"):
        table.add_column(col, justify="left" if col in ("text", "-ctk/-ctv") else "right")
    for r in rows:
        m, p = r["measured"], r["predicted"]
        table.add_row(r["text"], r["type"], f"{m['kld_mean']:.5f} ± {m['kld_unc']:.5f}", f"{p['kld_mean']:.5f}",
                      f"{r['ratio']:.2f}", f"{r['ratio_no_act']:.2f}" if r["ratio_no_act"] else "-",
                      f"{m['same_top_pct']:.1f} / {p['same_top_pct']:.1f}",
                      f"{m['ppl'] / m['ppl_base']:.4f} / {p['ppl'] / p['ppl_base']:.4f}")
    con.print(table)
    write_json(args.out, {
        "command": "python " + " ".join(sys.argv), "machine": cpu_model(), "cpus": os.cpu_count(),
        "threads": args.threads, "loadavg_start": load0, "loadavg_end": os.getloadavg(),
        "seconds": round(time.time() - t0, 1), "llamacpp": build.to_dict(), "gguf": gguf.name, "n_ctx": args.ctx,
        "protocol_differences": list(PROTOCOL_DIFFERENCES), "rows": rows,
    }, con)


if __name__ == "__main__":
    main()
