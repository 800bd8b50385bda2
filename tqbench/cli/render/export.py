"""Rich output and Markdown report of ``export`` (``deploy.ExportReport``). Front-end code, not engine."""

from __future__ import annotations

from rich.table import Table

from tqbench.cli.render.console import out


def _rows(rep) -> list[tuple[str, str, str, str, str, str]]:
    rows = []
    for what, r in (("original", rep.original), ("mapped", rep.mapped)):
        if r is None:
            continue
        rows.append((what, r.kv_policy, f"{r.bits_per_element:.3f}", f"{r.kl_mean:.5f}", f"{r.top1_agreement:.3f}",
                     f"{r.ppl_candidate:.3f} (fp16 {r.ppl_baseline:.3f})"))
    return rows


def _kld_rows(k) -> list[tuple[str, ...]]:
    rows = []
    for r in k.rows():
        meas = r.get("measured_kld")
        rows.append((r["text"], f"{r['predicted_kld']:.5f}",
                     f"{meas:.5f} ± {r['measured_kld_unc']:.5f}" if meas is not None else "not run (--verify)",
                     f"{r['predicted_over_measured']:.2f}" if r.get("predicted_over_measured") else "-",
                     f"{r['predicted_same_top_pct']:.1f}" + (f" / {r['measured_same_top_pct']:.1f}" if meas is not None
                                                             else ""),
                     f"{r['predicted_ppl_ratio']:.4f}" + (f" / {r['measured_ppl_ratio']:.4f}" if meas is not None
                                                         else ""),
                     str(r["scored_tokens"])))
    return rows


_KLD_COLS = ("text", "tqbench predicted KLD", "llama.cpp measured KLD", "pred/meas", "same top % (pred / meas)",
             "PPL ratio (pred / meas)", "scored tokens")


def _kld_lines(rep) -> list[str]:
    k = rep.llamacpp_kld
    lines = [f"protocol: {k.protocol}; tokens from {k.tokens_from}; {k.machine}"]
    if k.llamacpp:
        lines.append(f"llama.cpp {k.llamacpp['version']}: {k.llamacpp['origin']}")
    lines += [f"where the protocols differ: {d}" for d in k.differences]
    lines += [f"note: {r['note']}" for r in k.rows() if r["note"]][:1]
    return lines


def print_export(rep) -> None:
    print_mapping(rep.setting, rep.model)
    print_measured(rep)


def print_mapping(s, model: str) -> None:
    """The engine setting (flags or config lines) and what could not be mapped: printed before any measuring."""
    out.print(f"[bold]{s.policy}[/] on {s.engine_label} ({model}): K {s.k_type}, V {s.v_type}")
    for line in s.lines:
        out.print(f"  {line}", markup=False, highlight=False)
    if s.skip_layers:
        out.print(f"layers left unquantized: {', '.join(map(str, s.skip_layers))}")
    out.print(f"bits/element at {s.seq_len} tokens: policy {s.original_bits:.3f}, {s.engine_label} {s.mapped_bits:.3f}")
    if s.unmapped:
        out.print("[bold]could not map:[/]")
        for u in s.unmapped:
            out.print(f"  - {u}", markup=False, highlight=False)
    else:
        out.print("everything in the policy maps to this setting")
    for n in s.notes:
        out.print(f"note: {n}", markup=False, highlight=False)


def print_measured(rep) -> None:
    """What ``print_mapping`` leaves out: the policy's warning and the measurements."""
    s = rep.setting
    if rep.warning:
        out.print(f"warning: {rep.warning}", markup=False, highlight=False)
    if rep.measured is None:
        return
    from tqbench.engine.deploy.export import ENGINE_CHECK

    out.print(f"{s.engine_label}: {ENGINE_CHECK[s.engine]}", markup=False, highlight=False)
    m = rep.measured
    t = Table(title=f"measured here: teacher-forced on {m.source}, {m.prefill_tokens} prefill + {m.steps} scored "
                    f"tokens, {m.cache_mode} mode (bits/el of the cache at its {m.prefill_tokens + m.steps} tokens)")
    for col in ("", "policy", "bits/el", "KL mean", "top-1", "PPL"):
        t.add_column(col, justify="left" if col in ("", "policy") else "right")
    for row in _rows(rep):
        t.add_row(*row)
    out.print(t)
    c = rep.cost
    out.print(f"cost of the {s.engine_label} setting against the policy: KL {c['kl_mean_delta']:+.5f}, top-1 "
              f"{c['top1_delta']:+.3f}, bits/element at {s.seq_len} tokens {c['bits_per_element_delta']:+.3f} "
              f"({c['bytes_ratio']:.2f}x the bytes)", markup=False, highlight=False)
    if rep.llamacpp_kld_skipped:
        out.print(f"llama.cpp KLD: {rep.llamacpp_kld_skipped}", markup=False, highlight=False)
    if rep.llamacpp_kld is None:
        return
    k = rep.llamacpp_kld
    t = Table(title=f"llama.cpp -ctk {k.k} -ctv {k.v}: KLD against llama.cpp's f16 cache")
    for col in _KLD_COLS:
        t.add_column(col, justify="left" if col == "text" else "right")
    for row in _kld_rows(k):
        t.add_row(*row)
    out.print(t)
    for line in _kld_lines(rep):
        out.print(line, markup=False, highlight=False)


def export_md(rep) -> str:
    s = rep.setting
    lines = [f"# export {s.policy} to {s.engine_label}", "", f"Model: {rep.model}. K {s.k_type}, V {s.v_type}.", "",
             "```", *s.lines, "```", ""]
    if s.skip_layers:
        lines += [f"Layers left unquantized: {', '.join(map(str, s.skip_layers))}.", ""]
    lines += [f"Bits/element at {s.seq_len} tokens: policy {s.original_bits:.3f}, {s.engine_label} "
              f"{s.mapped_bits:.3f}.", ""]
    if s.unmapped:
        lines += ["Could not map:", "", *(f"- {u}" for u in s.unmapped), ""]
    lines += [f"Note: {n}" for n in s.notes]
    if rep.measured is not None:
        from tqbench.engine.deploy.export import ENGINE_CHECK

        lines += ["", f"{s.engine_label}: {ENGINE_CHECK[s.engine]}."]
        lines += ["", "| | policy | bits/el | KL mean | top-1 | PPL |", "| --- | --- | ---: | ---: | ---: | --- |"]
        lines += ["| " + " | ".join(r) + " |" for r in _rows(rep)]
    if rep.llamacpp_kld is not None:
        k = rep.llamacpp_kld
        lines += ["", f"llama.cpp -ctk {k.k} -ctv {k.v}: KLD against llama.cpp's f16 cache", "",
                  "| " + " | ".join(_KLD_COLS) + " |", "| --- |" + " ---: |" * (len(_KLD_COLS) - 1)]
        lines += ["| " + " | ".join(r) + " |" for r in _kld_rows(k)]
        lines += ["", *_kld_lines(rep)]
    elif rep.llamacpp_kld_skipped:
        lines += ["", f"llama.cpp KLD: {rep.llamacpp_kld_skipped}"]
    return "\n".join(lines) + "\n"
