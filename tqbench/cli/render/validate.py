"""Rich tables and Markdown reports of ``validate``: the lockstep verdict (``ValidationReport``) and
teacher-forced quality (``TeacherForcedReport``). Front-end code, not engine."""

from __future__ import annotations

from rich.table import Table

from tqbench.cli.render.console import out
from tqbench.cli.render.formats import EVIDENCE_HINT, num, pct, verdict_markup


# ---- lockstep validation ------------------------------------------------------------------------------
def print_validation(r) -> None:
    """``r``: engine.validate.report.ValidationReport."""
    c, s, ps, rec = r.comparison, r.step_comparison, r.policy_summary, r.policy_recommendation
    title = "self-test" if r.self_test else f"validate: {r.candidate} vs {r.baseline}"
    t = Table(title=f"{title} ({r.cache_mode})", show_header=False)
    t.add_column(style="bold")
    t.add_column()
    verdict = verdict_markup(r.quality_verdict) + (" [red](storage-only: no quality claim)[/]"
                                                   if r.storage_only else "")
    t.add_row("verdict", verdict)
    t.add_row("tokens", f"{c.baseline_tokens} baseline, {c.candidate_tokens} candidate; first divergence "
              f"{c.first_divergence_index if c.first_divergence_index is not None else 'none'}")
    t.add_row("token match", f"{c.token_match_ratio:.3f} (prefix {c.prefix_match_ratio:.3f}), "
              f"top-1 {s.top1_match_ratio:.3f}")
    lc = r.logit_comparison
    if lc:
        t.add_row("logits", f"KL mean {lc.kl_mean:.5f}, max {lc.kl_max:.5f}, max |dlogit| "
                  f"{lc.max_abs_logit_delta:.3f} over {lc.steps_compared} same-context steps")
    t.add_row("memory", f"{pct(ps.memory_saved_pct)} saved, {ps.compression_ratio:.2f}x, "
              f"{ps.bits_per_element:.2f} bits/element")
    t.add_row("throughput", f"{num(ps.throughput_ratio, '.2f')}x baseline decode "
              f"({ps.candidate_decode_tokens_per_second:.1f} vs {ps.baseline_decode_tokens_per_second:.1f} tok/s)")
    for key, value in _cache_rows(r.candidate_cache_report):
        t.add_row(key, value)
    t.add_row("recommendation", f"{rec.status}: {rec.next_step}"
              + (" (--cache-mode compressed)" if rec.status == "storage-only" else ""))
    if rec.savings is not None and not rec.savings.saves:
        t.add_row("savings", rec.savings.message)
    if rec.savings is not None and rec.savings.lengths_message:
        t.add_row("bytes at length", rec.savings.lengths_message)
    if rec.caveat:
        t.add_row("evidence", f"{rec.caveat} ({EVIDENCE_HINT['validate']})")
    t.add_row("cause hint", rec.cause_hint)
    if rec.next_policy:
        t.add_row("next policy", rec.next_policy)
    out.print(t)
    out.rule("baseline text")
    out.print(r.texts.baseline, markup=False, highlight=False)
    out.rule("candidate text")
    out.print(r.texts.candidate, markup=False, highlight=False)
    out.rule()


def _cache_rows(rep) -> list[tuple[str, str]]:
    """What ran in the candidate's fused calls (implementation -> calls, fallbacks) and its eviction note."""
    if rep is None:
        return []
    rows = []
    if rep.fused_impl:
        rows.append(("fused kernels", ", ".join(f"{impl}: {n} calls" for impl, n in rep.fused_impl.items())
                     + (f"; fallbacks {rep.fallbacks}" if rep.fallbacks else "")))
    rows += [("eviction", n) for n in rep.notes if n.startswith(("token eviction", "keep= "))]
    return rows


def validation_md(r) -> str:
    c, s, ps, rec = r.comparison, r.step_comparison, r.policy_summary, r.policy_recommendation
    lines = [
        f"# Validation: {r.candidate} vs {r.baseline}" if not r.self_test else "# Validation self-test",
        "",
        f"- model: {r.model}; cache mode {r.cache_mode} (baseline {r.baseline_mode})",
        f"- candidate policy: `{r.candidate_policy}`; baseline `{r.baseline_policy}`",
        f"- **verdict: {r.quality_verdict}**" + (" (storage-only: no quality claim)" if r.storage_only else ""),
        *(f"- {key}: {value}" for key, value in _cache_rows(r.candidate_cache_report)),
        "",
        "| metric | value |",
        "| --- | --- |",
        f"| first divergence index | {c.first_divergence_index} |",
        f"| token match ratio | {c.token_match_ratio:.4f} |",
        f"| prefix match ratio | {c.prefix_match_ratio:.4f} |",
        f"| top-1 match ratio | {s.top1_match_ratio:.4f} |",
    ]
    lc = r.logit_comparison
    if lc:
        lines += [f"| KL mean / max (nats) | {lc.kl_mean:.6f} / {lc.kl_max:.6f} |",
                  f"| max abs logit delta | {lc.max_abs_logit_delta:.4f} |"]
    lines += [
        f"| memory saved | {pct(ps.memory_saved_pct)} |",
        f"| compression ratio | {ps.compression_ratio:.3f}x |",
        f"| bits per element | {ps.bits_per_element:.3f} |",
        f"| throughput ratio | {num(ps.throughput_ratio, '.3f')} |",
        "",
        f"Recommendation: **{rec.status}** — {rec.next_step}. {rec.cause_hint}."
        + (f" Next policy to try: `{rec.next_policy}`." if rec.next_policy else ""),
        "",
    ]
    if rec.savings is not None and not rec.savings.saves:
        lines += [f"Savings: {rec.savings.message}.", ""]
    if rec.savings is not None and rec.savings.lengths_message:
        lines += [f"Bytes at the model's lengths: {rec.savings.lengths_message}.", ""]
    if rec.caveat:
        lines += [f"Evidence: {rec.caveat} ({EVIDENCE_HINT['validate']}).", ""]
    lines += [
        "## Baseline text", "", r.texts.baseline, "", "## Candidate text", "", r.texts.candidate, "",
    ]
    return "\n".join(lines)


# ---- teacher-forced quality -----------------------------------------------------------------------------
def print_teacher_forced(rep) -> None:
    """``rep``: engine.validate.quality.TeacherForcedReport (``results``: quality.TeacherForcedResult)."""
    t = Table(title=f"teacher-forced quality ({rep.source}, {rep.prefill_tokens} prefill, {rep.steps} steps, "
              f"{rep.cache_mode})")
    for col in ("policy", "bits/el", "saved", "ppl base", "ppl cand", "KL mean", "KL max", "top-1"):
        t.add_column(col, justify="right" if col != "policy" else "left")
    for r in rep.results:
        t.add_row(r.kv_policy, f"{r.bits_per_element:.2f}", pct(r.memory_saved_pct),
                  f"{r.ppl_baseline:.3f}", f"{r.ppl_candidate:.3f}", f"{r.kl_mean:.5f}",
                  f"{r.kl_max:.4f}", f"{r.top1_agreement:.3f}")
    out.print(t)


def teacher_forced_md(rep) -> str:
    lines = [f"# Teacher-forced quality ({rep.model}, {rep.source}, {rep.prefill_tokens} prefill tokens, "
             f"{rep.steps} steps, {rep.cache_mode})", "",
             "| policy | bits/element | saved | ppl baseline | ppl candidate | KL mean | KL max | top-1 |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rep.results:
        lines.append(f"| {r.kv_policy} | {r.bits_per_element:.2f} | {pct(r.memory_saved_pct)} | "
                     f"{r.ppl_baseline:.3f} | {r.ppl_candidate:.3f} | {r.kl_mean:.5f} | "
                     f"{r.kl_max:.4f} | {r.top1_agreement:.3f} |")
    return "\n".join(lines) + "\n"
