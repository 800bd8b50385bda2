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


def print_export(rep) -> None:
    s = rep.setting
    out.print(f"[bold]{s.policy}[/] on {s.engine_label} ({rep.model}): K {s.k_type}, V {s.v_type}")
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
    if rep.warning:
        out.print(f"warning: {rep.warning}", markup=False, highlight=False)
    if rep.measured is None:
        return
    m = rep.measured
    t = Table(title=f"measured here: teacher-forced on {m.source}, {m.prefill_tokens} prefill + {m.steps} scored "
                    f"tokens, {m.cache_mode} mode (bits/el of the cache at its {m.prefill_tokens + m.steps} tokens)")
    for col in ("", "policy", "bits/el", "KL mean", "top-1", "PPL"):
        t.add_column(col, justify="left" if col in ("", "policy") else "right")
    for row in _rows(rep):
        t.add_row(*row)
    out.print(t)


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
        lines += ["", "| | policy | bits/el | KL mean | top-1 | PPL |", "| --- | --- | ---: | ---: | ---: | --- |"]
        lines += ["| " + " | ".join(r) + " |" for r in _rows(rep)]
    return "\n".join(lines) + "\n"
