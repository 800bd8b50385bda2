"""Rich output of ``allocate`` (``AllocationReport``): the codecs per layer, the measured steps, and the verified
points (fitted vs unseen)."""

from __future__ import annotations

from rich.table import Table

from tqbench.cli.render.console import err, out
from tqbench.cli.render.formats import human_bytes


def _f(x, fmt: str = ".4f") -> str:
    return "-" if x is None else format(x, fmt)


def print_allocation(rep) -> None:
    a = rep.allocation
    t = Table(title=f"allocation for {rep.model}: {a.policy.label} (budget {a.budget_bits:g} bits/element at "
                    f"{a.estimate.seq_len} tokens, granularity {rep.setup['granularity']})")
    for col in ("layer", "K", "V", "KL K", "KL V"):
        t.add_column(col, justify="right")
    cell = {}
    for unit, spec in a.choice.items():
        cell[(unit[0], unit[1])] = cell.get((unit[0], unit[1]), 0.0) + rep.table.kl[unit][spec]
    for layer in rep.table.layers:
        t.add_row(str(layer), a.k[layer], a.v[layer], f"{cell.get((layer, 'k'), 0.0):.2e}",
                  f"{cell.get((layer, 'v'), 0.0):.2e}")
    out.print(t)
    out.print(f"policy: {a.policy.to_string()}")
    out.print(f"exact bytes at {a.estimate.seq_len} tokens: {a.estimate.total_bytes} ({human_bytes(a.estimate.total_bytes)})"
              f" = {a.bits_per_element:.4f} bits/element (fp16: {a.estimate.dense_fp16_bytes}); "
              f"additive KL {a.predicted_kl:.4f}, predicted (measured) KL {rep.predicted_kl:.4f}")
    out.print(f"sensitivity: {rep.measured_cells} cells measured, {rep.resumed_cells} resumed, on "
              f"{rep.setup['calibration']} ({rep.seconds['sensitivity']:.0f} s after a {rep.seconds.get('setup', 0):.0f} s "
              f"calibration prefill, {rep.seconds['threads']} threads)")
    if rep.axes:
        from tqbench.engine.allocate.head_keeps import keeps_text

        per = "KV head" if "head_keeps" in rep.axes else "layer"
        out.print(f"axes {','.join(rep.axes['axes'])} (score {rep.axes['score']}, window {rep.axes['window']}): bytes "
                  f"saved against fp16 by codecs {rep.axes['saved_by_codecs']}, by eviction "
                  f"{rep.axes['saved_by_eviction']}"
                  + (f" (net of {rep.axes['demoted_bytes']} in the demote tier)" if rep.axes.get("demotes") else "")
                  + f"; keep per {per}: {keeps_text(rep.axes)}")
    for note in rep.notes:
        out.print(f"note: {note}")
    if rep.speed is not None:
        print_speed(rep.speed)
    if rep.steps:
        s = Table(title="solver steps (joint chunk KL on the calibration sequences)")
        for col in ("step", "kind", "move", "additive KL", "measured KL", "bits/el", "accepted"):
            s.add_column(col, justify="left" if col in ("kind", "move") else "right")
        for st in rep.steps:
            s.add_row(str(st.step), st.kind, st.move, _f(st.predicted_kl), _f(st.measured_kl),
                      _f(st.bits_per_element, ".3f"), "yes" if st.accepted else "no")
        out.print(s)
    points = [p for p in (rep.verified, rep.unseen) if p is not None]
    if not points:
        out.print("not verified (--verify-text none --unseen-text none)")
        return
    f = Table(title=f"verified on text no step chose on: {points[0].prefill_tokens} prefill + {points[0].steps} "
                    "teacher-forced steps")
    for col in ("text", "bits/el", "report bits/el", "KL", "top-1", "ppl", "ppl delta"):
        f.add_column(col, justify="left" if col == "text" else "right")
    for v in points:
        f.add_row(v.text, f"{v.bits_per_element:.3f}", f"{v.report_bits_per_element:.3f}", f"{v.kl_mean:.4f}",
                  f"{v.top1_agreement:.3f}", f"{v.ppl_candidate:.3f}", f"{v.ppl_delta:+.3f}")
    out.print(f)
    fv = rep.fitted_vs_unseen()
    out.print(f"fitted vs unseen: predicted {_f(fv['predicted_kl'])} ({fv['predictor']}), verification "
              f"{_f(fv['verification_kl'])}, unseen {_f(fv['unseen_kl'])}; unseen/verification "
              f"{_f(fv['unseen_over_verification'], '.2f')}, predicted/verification "
              f"{_f(fv['predicted_over_verification'], '.2f')}")
    for text, u in rep.uniform.items():
        out.print(f"uniform policy of no more bytes on {text}: {u['kv_policy']} at {u['bits_per_element']:.3f} "
                  f"bits/element, KL {u['kl_mean']:.4f}, top-1 {u['top1_agreement']:.3f}")


def print_speed(sp) -> None:
    """Predicted (and measured) decode speed vs dense, the minimum it met and the cost table it came from."""
    rule = {"given": "given", "reference": f"uniform {sp.reference}'s", "none": "none"}[sp.min_source]
    minimum = "no minimum" if sp.min_ratio is None else f"minimum {sp.min_ratio:.3f}x ({rule})"
    if sp.relaxed_to is not None:
        minimum = (f"minimum {sp.relaxed_to:.3f}x (uniform {sp.reference}'s {sp.reference_ratio:.3f}x is out of reach "
                   "within the budget: the best reachable)")
    measured = "" if sp.measured is None else (
        f"; measured {sp.measured_ratio:.3f}x ({sp.measured['policy_tok_s']:.2f} vs {sp.measured['dense_tok_s']:.2f} "
        f"tok/s dense, {sp.measured['steps']} interleaved steps)")
    changed = ""
    if sp.unconstrained_ratio is not None and sp.constrained:
        changed = f"; the least-KL policy was predicted at {sp.unconstrained_ratio:.3f}x, so the speed changed it"
    out.print(f"decode speed vs dense at {sp.context} tokens (fused): predicted {sp.predicted_ratio:.3f}x, {minimum}, "
              f"uniform {sp.reference} {sp.reference_ratio:.3f}x{measured}{changed}")
    t = Table(title=f"decode cost per stored row and KV head, ns (one layer's fused call; other role {sp.reference})")
    rows = sp.costs.per_row()
    codecs = list(dict.fromkeys([*rows["k"], *rows["v"]]))
    t.add_column("role")
    for c in codecs:
        t.add_column(c, justify="right")
    for role in ("k", "v"):
        t.add_row(role.upper(), *[_f(rows[role].get(c), ".1f") for c in codecs])
    out.print(t)
    out.print(f"mixed-codec layer overhead {sp.costs.mixed * 1e6:.1f} us; dense step {sp.costs.dense_step * 1e3:.2f} ms,"
              f" uniform {sp.reference} step {sp.costs.reference_step * 1e3:.2f} ms "
              f"({sp.costs.machine.get('threads', '?')} threads)")


#: the phases of ``AllocationReport.seconds`` in the order they run
PHASES = ("calibrate", "setup", "sensitivity", "solve_and_measure", "verify")


def print_phases(rep) -> None:
    """One line on stderr: wall and CPU seconds per phase, the total, the threads (``--json`` keeps stdout clean)."""
    sec = rep.seconds
    cpu = sec.get("cpu", {})
    parts = [f"{p} {sec[p]:.0f} s wall / {cpu.get(p, 0):.0f} s CPU" for p in PHASES if p in sec]
    err.print(f"phases: {'; '.join(parts)}; total {sec.get('total', 0):.0f} s wall / {sec.get('total_cpu', 0):.0f} s "
              f"CPU at {sec.get('threads', '?')} threads, context {rep.allocation.estimate.seq_len} tokens",
              highlight=False, soft_wrap=True)
