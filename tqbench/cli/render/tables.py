"""Rich tables for ``bench`` (a run and its cache report) and ``policies`` (the preset list), with the typed
records their ``--json`` payloads come from. Front-end code, not engine."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from rich.table import Table

from tqbench.cli.render.console import out
from tqbench.cli.render.formats import mib
from tqbench.constants import DENSE_BASELINE_ATTENTION, dense_baseline_label

#: SmolLM2-135M-Instruct's KV geometry (30 layers, 3 KV heads, head_dim 64), for policy listings


# ---- bench ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BaselineRun:
    """``bench --baseline``: the dense cache the same tokens were generated with, and its decode speed."""

    name: str  # a DENSE_BASELINES name
    kv_dtype: str  # what its K/V rows are stored in
    decode_tokens_per_second: float

    def to_dict(self, policy_tps: float) -> dict:
        base = self.decode_tokens_per_second
        return {"name": self.name, "kv_dtype": self.kv_dtype, "attention": DENSE_BASELINE_ATTENTION[self.name],
                "decode_tokens_per_second": round(base, 3),
                "decode_ratio": round(policy_tps / base, 4) if base else None}


@dataclass(frozen=True)
class BenchRun:
    """One ``bench`` run: the engine's ``GenerationResult`` and where it ran; ``to_dict()`` is ``--json``."""

    result: object  # engine.generate.GenerationResult
    kv_policy: str
    kv_policy_string: str
    model: str
    device: str
    dtype: str
    threads: int
    baseline: BaselineRun | None = None

    @classmethod
    def of(cls, engine, result, policy, threads: int) -> BenchRun:
        return cls(result, policy.label, policy.to_string(), engine.name, str(engine.loaded.device),
                   str(engine.loaded.dtype).replace("torch.", ""), threads)

    def to_dict(self) -> dict:
        rep = self.result.cache_report
        d = self.result.to_dict()
        d.pop("run", None)
        d["kv_policy"] = self.kv_policy
        d["kv_policy_string"] = self.kv_policy_string
        d["model"] = self.model
        d["device"] = self.device
        d["dtype"] = self.dtype
        d["threads"] = self.threads
        d["cache_report"] = rep.to_dict() if rep is not None else None
        if self.baseline is not None:
            d["baseline"] = self.baseline.to_dict(self.result.decode_tokens_per_second)
        return d


def print_bench(run: BenchRun, per_layer: bool = False) -> None:
    res, rep = run.result, run.result.cache_report
    t = Table(title=f"bench: {run.kv_policy} ({res.cache_mode})", show_header=False)
    t.add_column(style="bold")
    t.add_column()
    t.add_row("model", f"{run.model} on {run.device} ({run.dtype}, {run.threads} threads)")
    t.add_row("policy", run.kv_policy_string)
    t.add_row("tokens", f"{res.input_tokens} in, {res.output_tokens} out (stopped by {res.stopped_by})")
    t.add_row("prefill", f"{res.prefill_seconds:.2f} s ({res.input_tokens / max(res.prefill_seconds, 1e-9):.0f} tok/s)")
    t.add_row("decode", f"{res.decode_tokens_per_second:.1f} tok/s")
    if run.baseline is not None:
        b = run.baseline.to_dict(res.decode_tokens_per_second)
        ratio = "-" if b["decode_ratio"] is None else f"{b['decode_ratio']:.2f}x"
        t.add_row("baseline", f"{dense_baseline_label(b['name'], run.dtype)}: {b['decode_tokens_per_second']:.1f} "
                              f"tok/s decode; policy {ratio} of it")
    t.add_row("total", f"{res.elapsed_seconds:.2f} s, {res.tokens_per_second:.1f} tok/s")
    if rep is not None:
        _cache_rows(t, rep)
    out.print(t)
    if rep is not None and per_layer:
        print_layers(rep)


def _cache_rows(t: Table, rep) -> None:
    """The cache report's rows of the bench table (``rep``: engine.cache.report.CacheReport)."""
    t.add_row("KV stored", f"{mib(rep.compressed_storage_bytes)} vs fp16 {mib(rep.dense_fp16_bytes)} "
              f"({rep.bits_per_element:.2f} bits/element)")
    t.add_row("saved at rest", f"{rep.memory_saved_pct:.1f}%")
    t.add_row("resident in decode", f"{mib(rep.resident_decode_bytes)} "
              f"({rep.active_decode_memory_saved_pct:.1f}% saved, mode {rep.cache_mode})")
    t.add_row("shared objects", f"{rep.shared_bytes} B (rotations, codebooks; counted once)")
    for note in rep.notes:
        t.add_row("note", note)
    if rep.bypassed_layers:
        t.add_row("layer notes", "; ".join(f"L{b['layer']}: {b['reason']}" for b in rep.bypassed_layers[:6])
                  + (" ..." if len(rep.bypassed_layers) > 6 else ""))


def print_layers(rep) -> None:
    """Per-layer bytes of a ``CacheReport``."""
    t = Table(title="per-layer bytes")
    for col in ("layer", "K", "V", "tokens", "K pk", "V pk", "K bytes", "V bytes", "fp16 bytes", "bits"):
        t.add_column(col, justify="right")
    for r in rep.layers:
        t.add_row(str(r.layer), r.k_codec, r.v_codec, str(r.tokens), str(r.k_packed_tokens),
                  str(r.v_packed_tokens), str(r.k_bytes), str(r.v_bytes), str(r.dense_fp16_bytes),
                  f"{r.bits_per_element:.2f}")
    total = sum(r.total_bytes for r in rep.layers)
    t.add_row("sum", "", "", "", "", "", "", str(total), str(rep.dense_fp16_bytes), "")
    t.caption = f"layers {total} B + shared {rep.shared_bytes} B = {rep.compressed_storage_bytes} B"
    out.print(t)


# ---- policies --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PresetRow:
    """One preset of ``tqbench policies``; ``to_dict()`` is its ``--json`` row."""

    name: str
    policy: str
    meaning: str
    bits_per_element: float
    saved_pct: float
    kv_bytes: int
    dense_fp16_bytes: int
    seq_len: int

    def to_dict(self) -> dict:
        return asdict(self)


def preset_rows(seq_len: int) -> list[PresetRow]:
    """Every preset, then every shipped (model-specific) policy file, by name, then the engines' own settings."""
    from tqbench.engine import estimate_kv, get_preset, parse_policy
    from tqbench.engine.cache import default_geometry
    from tqbench.engine.codecs.engine_formats import describe_setting
    from tqbench.engine.policy import ENGINE_PRESETS, PRESET_TEXT, shipped_policy_names

    geo = default_geometry()
    named = [(name, get_preset(name), meaning) for name, (_, meaning) in PRESET_TEXT.items()]
    named += [(name, parse_policy(name), shipped_meaning(name)) for name in shipped_policy_names()
              if name not in PRESET_TEXT]
    named += [(name, parse_policy(name), describe_setting(name)) for name in ENGINE_PRESETS]
    rows = []
    for name, pol, meaning in named:
        est = estimate_kv(pol, geo, seq_len)
        rows.append(PresetRow(name=name, policy=pol.to_string(), meaning=meaning,
                              bits_per_element=round(est.bits_per_element, 3), saved_pct=round(est.saved_pct, 2),
                              kv_bytes=est.total_bytes, dense_fp16_bytes=est.dense_fp16_bytes, seq_len=seq_len))
    return rows


def shipped_meaning(name: str) -> str:
    """A shipped policy file's one-line meaning: its ``description``, else the model it was fitted on."""
    from tqbench.engine.policy.presets import shipped_policy_path
    from tqbench.engine.tomlfile import read_toml

    path = shipped_policy_path(name)
    data = read_toml(path, "shipped policy file") if path.suffix == ".toml" else {}
    model = (data.get("model") or {}).get("name")
    return data.get("description") or f"shipped policy file{f' (fitted on {model})' if model else ''}"


def print_presets(rows: list[PresetRow], seq_len: int) -> None:
    t = Table(title=f"policy presets (SmolLM2-135M geometry, {seq_len} tokens, all metadata counted)")
    t.add_column("name", style="bold")
    t.add_column("policy")
    t.add_column("bits/el", justify="right")
    t.add_column("saved", justify="right")
    t.add_column("meaning")
    for r in rows:
        t.add_row(r.name, r.policy, f"{r.bits_per_element:.2f}", f"{r.saved_pct:.1f}%", r.meaning)
    out.print(t)
