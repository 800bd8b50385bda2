"""Calibrated transforms vs the random rotation on real K/V of the default model, on text the fit never saw.

``python benchmarks/transforms.py`` captures Q/K/V of every layer on the calibration texts and on held-out texts,
fits the ``pcaq`` transforms (a) on the calibration mix and (b) on one kind of text (prose), and measures per
(layer, KV head), averaged over all of them: relative q.k score error, softmax KL(exact || quantized) and the
relative attention-output error, with only K quantized (V exact) at 2, 3, 4 bits, pcaq vs turbo (centered keys,
norm correction, as policies build it), at equal bits per row (turbo's fp16 norm counted: pcaq gets its 16 bits
as index bits, e.g. pcaq2.25 against turbo2). V: turbo vs a plain PCA basis with water-filled bits (fitted in
the identity metric), V only quantized. Prints tables, writes ``benchmarks/results/transforms.json``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
import time
from pathlib import Path

from _common import cpu_model, write_json

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

HELDOUT = ("heldout:code", "heldout:technical", "corpus:rivers")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--bits", default="2,3,4")
    p.add_argument("--layers", default="all", help="'all' or a stride like ::3 (every third layer) for a quicker run")
    p.add_argument("--texts", default="prose," + ",".join(HELDOUT),
                   help="texts to measure on (prose is the single-kind fit's own text)")
    p.add_argument("--no-v", action="store_true", help="skip the V comparison")
    p.add_argument("--fits", default=None, help="reuse fitted files: mix=FILE,prose=FILE (skips those fits)")
    p.add_argument("--cache", default=None, help="a .pt file to keep the captures in (reused when present)")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/transforms.json"))
    p.add_argument("--save-mix", default=None, help="also write the calibration-mix fit here (.safetensors)")
    return p.parse_args(argv)


def capture_all(engine, names, tokens, cache):
    import torch

    from tqbench.engine.calibrate import text_path
    from tqbench.engine.scan import capture_qkv

    if cache and os.path.exists(cache):
        return torch.load(cache, weights_only=False)
    caps = {}
    for name in names:
        cap = capture_qkv(engine, text_path(name).read_text(encoding="utf-8"), None, tokens, 0, chat=False)
        caps[name] = cap.layers
        print(f"captured {name}: {len(cap.token_ids)} tokens", flush=True)
    if cache:
        torch.save(caps, cache)
    return caps


def v_transforms(caps, names, model, fp):
    """A plain PCA of V (identity metric) in the pcaq file format, to measure V through the same codec."""
    import torch

    from tqbench.engine.calibrate import fit_from_layers
    from tqbench.engine.scan import LayerQKV

    swapped = []
    for n in names:
        layers = {}
        for i, d in caps[n].items():
            eye = torch.eye(d.v.shape[-1]).repeat(d.q.shape[0] // d.v.shape[0] * d.v.shape[0], 1, 1)
            layers[i] = LayerQKV(i, eye, d.v, d.v, d.scaling)
        swapped.append(layers)
    return fit_from_layers(swapped, model=model, fingerprint=fp)


def measure(caps, name, spec_k, spec_v, calib_k, calib_v, stride=1):
    """Mean over layers and heads of the scan metrics (K through spec_k, V through spec_v; None = exact)."""
    import torch

    from tqbench.engine.codecs import codec_from_spec
    from tqbench.engine.policy import Policy
    from tqbench.engine.scan import head_metrics

    pol = Policy()
    sums: dict[str, float] = {}
    n = 0
    for layer, d in sorted(caps[name].items())[::stride]:
        def through(spec, role, x, calib, layer=layer):
            if spec is None:
                return x
            if spec.startswith("pcaq"):
                codec = codec_from_spec(spec, "k", layer=layer, calib=calib)
            else:
                codec = pol.build_codec(spec, role)
            st = codec.calibrate(x[None])
            return codec.decode(codec.encode(x[None], st), st, torch.float32)[0]

        kq = through(spec_k, "k", d.k, calib_k)
        vq = through(spec_v, "v", d.v, calib_v)
        g = d.q.shape[0] // d.k.shape[0]
        for h in range(d.k.shape[0]):
            m = head_metrics(d.q[h * g:(h + 1) * g], d.k[h], d.v[h], kq[h], vq[h], d.scaling)
            for key in ("score_rel_err", "softmax_kl", "attn_out_rel_err", "k_rel_mse", "v_rel_mse"):
                sums[key] = sums.get(key, 0.0) + m[key]
            n += 1
    return {k: v / n for k, v in sums.items()}


def main(argv=None) -> None:
    a = parse_args(argv)
    import torch

    from tqbench.engine import Engine
    from tqbench.engine.calibrate import DEFAULT_MIX, fit_from_layers
    from tqbench.engine.codecs.transforms_file import save_transforms

    torch.set_num_threads(a.threads)
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    names = list(DEFAULT_MIX) + list(HELDOUT)
    if a.cache and os.path.exists(a.cache):  # the captures are kept: the model is only needed for its identity
        from tqbench.engine.codecs.transforms_file import load_transforms

        shipped = load_transforms()
        engine = type("Known", (), {"name": shipped.model})()
        caps, fp = capture_all(None, names, a.tokens, a.cache), shipped.fingerprint
    else:
        engine = Engine.load(threads=a.threads)
        caps, fp = capture_all(engine, names, a.tokens, a.cache), engine.loaded.fingerprint
    tmp = Path(tempfile.mkdtemp())
    used = [{"text": n, "tokens": next(iter(caps[n].values())).k.shape[1]} for n in DEFAULT_MIX]
    files = dict(kv.split("=", 1) for kv in a.fits.split(",")) if a.fits else {}
    if "mix" not in files:
        mix = fit_from_layers([caps[n] for n in DEFAULT_MIX], model=engine.name, fingerprint=fp, calibration=used)
        files["mix"] = str(save_transforms(mix, a.save_mix or tmp / "mix.safetensors"))
    if "prose" not in files:
        prose = fit_from_layers([caps["prose"]], model=engine.name, fingerprint=fp, calibration=used[:1])
        files["prose"] = str(save_transforms(prose, tmp / "prose.safetensors"))
    print("fitted", flush=True)
    vfile = None if a.no_v else str(save_transforms(v_transforms(caps, DEFAULT_MIX, engine.name, fp),
                                                       tmp / "v-mix.safetensors"))
    stride = 1 if a.layers == "all" else int(a.layers.strip(":"))
    bits = [int(b) for b in a.bits.split(",")]
    rows = []
    texts = a.texts.split(",")  # prose: the single-kind fit's own text (fitted); the held-out ones unseen by both
    for text in texts:
        for b in bits:
            base = measure(caps, text, f"turbo{b}", None, None, None, stride)
            rows.append({"side": "K", "text": text, "bits": b, "codec": f"turbo{b}", "fit": "-", **base})
            for fit in ("mix", "prose"):
                for spec in (f"pcaq{b}", f"pcaq{b + 0.25:g}"):
                    m = measure(caps, text, spec, None, files[fit], None, stride)
                    rows.append({"side": "K", "text": text, "bits": b, "codec": spec, "fit": fit, **m})
            if vfile is None or b > 3:
                print(f"{text} {b} bits done", flush=True)
                continue
            vb = measure(caps, text, None, f"turbo{b}", None, None, stride)
            rows.append({"side": "V", "text": text, "bits": b, "codec": f"turbo{b}", "fit": "-", **vb})
            for spec in (f"pcaq{b}", f"pcaq{b + 0.25:g}"):
                m = measure(caps, text, None, spec, None, vfile, stride)
                rows.append({"side": "V", "text": text, "bits": b, "codec": spec + " (V basis)", "fit": "mix", **m})
            print(f"{text} {b} bits done", flush=True)
    hdr = f"{'side':4} {'text':18} {'bits':>4} {'codec':18} {'fit':5} {'score_err':>9} {'kl':>9} {'out_err':>8}"
    print(hdr)
    for r in rows:
        print(f"{r['side']:4} {r['text']:18} {r['bits']:>4} {r['codec']:18} {r['fit']:5} {r['score_rel_err']:9.5f} "
              f"{r['softmax_kl']:9.5f} {r['attn_out_rel_err']:8.5f}")
    payload = {"benchmark": "transforms", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
               "cpu": cpu_model(), "threads": a.threads, "load_before": load0, "load_after": os.getloadavg(),
               "tokens": a.tokens, "calibration_mix": list(DEFAULT_MIX), "texts": texts, "layer_stride": stride,
               "command": sys.argv,
               "seconds": round(time.perf_counter() - t0, 1), "rows": rows}
    write_json(a.out, payload)


if __name__ == "__main__":
    main()
