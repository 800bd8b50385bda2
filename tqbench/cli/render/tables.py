"""Rich rendering for the headless CLI: progress, tables, JSON payloads. Front-end code, not engine."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.table import Table

err = Console(stderr=True)
out = Console()
if not out.is_terminal:  # pipes and files get full-width tables instead of 80 columns
    out = Console(width=160)

#: SmolLM2-135M-Instruct's KV geometry (30 layers, 3 KV heads, head_dim 64), for policy listings
DEFAULT_GEOMETRY = (30, 3, 64)


def load_engine(model: str, device: str, dtype: str, threads: int | None, quiet: bool = False):
    from tqbench.engine.engine import Engine

    with err.status(f"loading {model} ...", spinner="dots") as status:
        engine = Engine.load(model, device=device, dtype=dtype, threads=threads,
                             on_progress=lambda m: status.update(m))
    info = engine.loaded
    if not quiet:
        err.print(
            f"[bold]{info.name}[/] on {info.device} ({str(info.dtype).replace('torch.', '')}), "
            f"{info.num_params / 1e6:.0f}M parameters, loaded in {info.load_seconds:.1f}s"
        )
    return engine


class TokenPrinter:
    """Streams generated text to stdout as it arrives."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.started = False

    def token(self, delta: str) -> None:
        if self.enabled and delta:
            if not self.started:
                err.rule("generated text")
                self.started = True
            sys.stdout.write(delta)
            sys.stdout.flush()

    def close(self) -> None:
        if self.enabled and self.started:
            sys.stdout.write("\n")
            err.rule()


def bench_payload(engine, result, policy) -> dict:
    rep = result.cache_report
    d = result.to_dict()
    d.pop("run", None)
    d["kv_policy"] = policy.label
    d["kv_policy_string"] = policy.to_string()
    d["model"] = engine.name
    d["device"] = str(engine.loaded.device)
    d["dtype"] = str(engine.loaded.dtype).replace("torch.", "")
    d["threads"] = _threads()
    d["cache_report"] = rep.to_dict() if rep is not None else None
    return d


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def _mb(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 1024:.1f} KiB"


def print_bench(p: dict, per_layer: bool = False) -> None:
    rep = p["cache_report"]
    t = Table(title=f"bench: {p['kv_policy']} ({p['cache_mode']})", show_header=False)
    t.add_column(style="bold")
    t.add_column()
    t.add_row("model", f"{p['model']} on {p['device']} ({p['dtype']}, {p['threads']} threads)")
    t.add_row("policy", p["kv_policy_string"])
    t.add_row("tokens", f"{p['input_tokens']} in, {p['output_tokens']} out (stopped by {p['stopped_by']})")
    t.add_row("prefill", f"{p['prefill_seconds']:.2f} s ({p['input_tokens'] / max(p['prefill_seconds'], 1e-9):.0f} tok/s)")
    t.add_row("decode", f"{p['decode_tokens_per_second']:.1f} tok/s")
    t.add_row("total", f"{p['elapsed_seconds']:.2f} s, {p['tokens_per_second']:.1f} tok/s")
    if rep:
        t.add_row("KV stored", f"{_mb(rep['compressed_storage_bytes'])} vs fp16 {_mb(rep['dense_fp16_bytes'])} "
                  f"({rep['bits_per_element']:.2f} bits/element)")
        t.add_row("saved at rest", f"{rep['memory_saved_pct']:.1f}%")
        t.add_row("resident in decode", f"{_mb(rep['resident_decode_bytes'])} "
                  f"({rep['active_decode_memory_saved_pct']:.1f}% saved, mode {rep['cache_mode']})")
        t.add_row("shared objects", f"{rep['shared_bytes']} B (rotations, codebooks; counted once)")
        for note in rep["notes"]:
            t.add_row("note", note)
        if rep["bypassed_layers"]:
            t.add_row("layer notes", "; ".join(f"L{b['layer']}: {b['reason']}" for b in rep["bypassed_layers"][:6])
                      + (" ..." if len(rep["bypassed_layers"]) > 6 else ""))
    out.print(t)
    if rep and per_layer:
        print_layers(rep)


def print_layers(rep: dict) -> None:
    t = Table(title="per-layer bytes")
    for col in ("layer", "K", "V", "tokens", "K pk", "V pk", "K bytes", "V bytes", "fp16 bytes", "bits"):
        t.add_column(col, justify="right")
    for r in rep["layers"]:
        el = r["dense_fp16_bytes"] // 2
        bits = r["total_bytes"] * 8 / el if el else 0
        t.add_row(str(r["layer"]), r["k_codec"], r["v_codec"], str(r["tokens"]), str(r["k_packed_tokens"]),
                  str(r["v_packed_tokens"]), str(r["k_bytes"]), str(r["v_bytes"]), str(r["dense_fp16_bytes"]),
                  f"{bits:.2f}")
    total = sum(r["total_bytes"] for r in rep["layers"])
    t.add_row("sum", "", "", "", "", "", "", str(total), str(rep["dense_fp16_bytes"]), "")
    t.caption = f"layers {total} B + shared {rep['shared_bytes']} B = {rep['compressed_storage_bytes']} B"
    out.print(t)


def preset_rows(seq_len: int) -> list[dict]:
    from tqbench.engine.cache.estimate import KVGeometry, estimate_kv
    from tqbench.engine.policy.spec import PRESET_TEXT, get_preset

    geo = KVGeometry(*DEFAULT_GEOMETRY)
    rows = []
    for name, (_, meaning) in PRESET_TEXT.items():
        pol = get_preset(name)
        est = estimate_kv(pol, geo, seq_len)
        rows.append({
            "name": name, "policy": pol.to_string(), "meaning": meaning,
            "bits_per_element": round(est.bits_per_element, 3), "saved_pct": round(est.saved_pct, 2),
            "kv_bytes": est.total_bytes, "dense_fp16_bytes": est.dense_fp16_bytes, "seq_len": seq_len,
        })
    return rows


def print_presets(rows: list[dict], seq_len: int) -> None:
    t = Table(title=f"policy presets (SmolLM2-135M geometry, {seq_len} tokens, all metadata counted)")
    t.add_column("name", style="bold")
    t.add_column("policy")
    t.add_column("bits/el", justify="right")
    t.add_column("saved", justify="right")
    t.add_column("meaning")
    for r in rows:
        t.add_row(r["name"], r["policy"], f"{r['bits_per_element']:.2f}", f"{r['saved_pct']:.1f}%", r["meaning"])
    out.print(t)
