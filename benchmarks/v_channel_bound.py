"""How much a per-channel scale of the values could gain, at best, before any codec is tried (issue 39 item 4).

A turbo value row is normalized and rotated, so its quantization error is near-isotropic with energy proportional
to the row's. A per-channel scale ``s`` applied before (and undone after) changes the error a layer's output sees
through ``o_proj`` from ``(sum a)(sum b)`` to ``(sum a/s^2)(sum s^2 b)`` (times the same constant), where ``a_c`` is
the squared norm of ``o_proj``'s columns that read channel ``c`` (summed over the query heads sharing the KV head)
and ``b_c`` the values' mean square in channel ``c``. The best scale, ``s_c^2 = sqrt(a_c / b_c)``, gives
``(sum sqrt(a b))^2``: the ratio printed per layer is that bound over the unscaled error (1.0: nothing to gain).
Values from an exact prefill of one text (a sliding layer: the rows its window holds).

    python benchmarks/v_channel_bound.py --model gemma3-270m --threads 1 --json benchmarks/results/v_channel_bound-gemma.json
"""

from __future__ import annotations

import argparse
import os

import torch
from _common import write_json
from transformers import DynamicCache

from tqbench.engine.allocate.texts import text_ids
from tqbench.engine.engine import Engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--text", default="heldout:technical")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    engine = Engine.load(args.model, threads=args.threads)
    ids, label = text_ids(engine.tokenizer, args.text, args.tokens)
    cache = DynamicCache(config=engine.config)
    with torch.inference_mode():
        engine.model(input_ids=ids, cache=cache, use_cache=True)
    g = engine.geometry
    layers = engine.model.get_decoder().layers
    rows = []
    for i, layer in enumerate(layers):
        v = cache.layers[i].values[0].double()  # [kv_heads, tokens, d]
        w = layer.self_attn.o_proj.weight.detach().double()  # [hidden, q_heads * d]
        q_heads = w.shape[1] // g.v_dim
        per_kv = q_heads // g.kv_heads
        a_cols = (w ** 2).sum(0).view(q_heads, g.v_dim)
        ratios = []
        for h in range(g.kv_heads):
            a = a_cols[h * per_kv:(h + 1) * per_kv].sum(0)
            b = (v[h] ** 2).mean(0)
            ratios.append(float((torch.sqrt(a * b).sum() ** 2) / (a.sum() * b.sum())))
        rows.append({"layer": i, "bound": ratios, "b_max_over_mean": float((v ** 2).mean(1).max() / (v ** 2).mean())})
        print(f"layer {i:2d}: best per-channel scale leaves {min(ratios):.3f}-{max(ratios):.3f} of the V error "
              f"(channel energy max/mean {rows[-1]['b_max_over_mean']:.1f})", flush=True)
    write_json(args.json, {"model": engine.loaded.name, "text": label, "tokens": args.tokens, "rows": rows,
                           "threads": torch.get_num_threads(), "load": os.getloadavg()})


if __name__ == "__main__":
    main()
