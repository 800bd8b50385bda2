"""Rich output of ``allocate`` (``AllocationReport``): the per-layer codecs and the verified frontier point."""

from __future__ import annotations

from rich.table import Table

from tqbench.cli.render.console import out
from tqbench.cli.render.formats import human_bytes


def print_allocation(rep) -> None:
    a = rep.allocation
    t = Table(title=f"allocation for {rep.model}: {a.policy.label} (budget {a.budget_bits:g} bits/element at "
                    f"{a.estimate.seq_len} tokens)")
    for col in ("layer", "K", "V", "KL K", "KL V"):
        t.add_column(col, justify="right")
    for layer in rep.table.layers:
        t.add_row(str(layer), a.k[layer], a.v[layer], f"{rep.table.get(layer, 'k', a.k[layer]):.2e}",
                  f"{rep.table.get(layer, 'v', a.v[layer]):.2e}")
    out.print(t)
    out.print(f"policy: {a.policy.to_string()}")
    out.print(f"exact bytes at {a.estimate.seq_len} tokens: {a.estimate.total_bytes} ({human_bytes(a.estimate.total_bytes)})"
              f" = {a.bits_per_element:.4f} bits/element (fp16: {a.estimate.dense_fp16_bytes}); "
              f"predicted KL {a.predicted_kl:.4f}")
    out.print(f"sensitivity: {rep.measured_cells} cells measured, {rep.resumed_cells} resumed, on "
              f"{rep.setup['calibration']} ({rep.seconds['sensitivity']:.0f} s, {rep.seconds['threads']} threads)")
    v = rep.verified
    if v is None:
        out.print("not verified (--verify-text none)")
        return
    f = Table(title=f"verified on {v.text} (not seen by the allocator): {v.prefill_tokens} prefill + {v.steps} "
                    "teacher-forced steps")
    for col in ("policy", "bits/el", "report bits/el", "KL", "top-1", "ppl", "ppl delta"):
        f.add_column(col, justify="left" if col == "policy" else "right")
    f.add_row(v.kv_policy, f"{v.bits_per_element:.3f}", f"{v.report_bits_per_element:.3f}", f"{v.kl_mean:.4f}",
              f"{v.top1_agreement:.3f}", f"{v.ppl_candidate:.3f}", f"{v.ppl_delta:+.3f}")
    out.print(f)
