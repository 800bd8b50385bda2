"""Rich rendering and Markdown reports for the validation suite (front-end code, not engine)."""

from __future__ import annotations

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from tqbench.cli.render.tables import err, out

VERDICT_STYLE = {"exact-match": "green", "near-stable": "yellow", "prefix-stable-then-diverged": "dark_orange",
                 "diverged": "red"}


class EventProgress:
    """An ``on_event`` callback that draws engine events as a rich progress bar on stderr."""

    def __init__(self, enabled: bool = True, total: float | None = None, label: str = "work") -> None:
        self.enabled = enabled
        self.total = total
        self.label = label
        self.progress = None
        self.task = None
        self.tasks: dict[str, int] = {}

    def __enter__(self) -> EventProgress:
        if self.enabled:
            self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                     TimeElapsedColumn(), console=err, transient=True)
            self.progress.__enter__()
            self.task = self.progress.add_task(self.label, total=self.total)
        return self

    def __exit__(self, *exc) -> None:
        if self.progress is not None:
            self.progress.__exit__(*exc)

    def __call__(self, ev: object) -> None:
        if self.progress is None:
            return
        from tqbench.engine import events as E

        p = self.progress
        if isinstance(ev, E.PairStep):
            p.update(self.task, completed=ev.step + 1, description=f"{self.label}: step {ev.step + 1}")
        elif isinstance(ev, E.Progress):
            if ev.task in ("baseline", "candidate"):  # teacher-forced steps
                if ev.task not in self.tasks:
                    self.tasks[ev.task] = p.add_task(f"teacher-forced {ev.task}", total=ev.total)
                p.update(self.tasks[ev.task], completed=ev.done, total=ev.total)
            else:
                p.update(self.task, completed=ev.done, total=ev.total,
                         description=f"{self.label}: {ev.message}" if ev.message else self.label)
        elif isinstance(ev, E.ScanLayerDone):
            p.update(self.task, completed=ev.index + 1, total=ev.total, description=f"scan: layer {ev.layer}")


def _f(x, fmt: str = ".4f") -> str:
    return "-" if x is None else format(x, fmt)


def _pct(x) -> str:
    return "-" if x is None else f"{x:.1f}%"


def _v(verdict: str) -> str:
    return f"[{VERDICT_STYLE.get(verdict, 'white')}]{verdict}[/]"


# ---- validate -----------------------------------------------------------------------------------------
def print_validation(p: dict) -> None:
    c, s, ps, rec = p["comparison"], p["step_comparison"], p["policy_summary"], p["policy_recommendation"]
    title = "self-test" if p["self_test"] else f"validate: {p['candidate']} vs {p['baseline']}"
    t = Table(title=f"{title} ({p['cache_mode']})", show_header=False)
    t.add_column(style="bold")
    t.add_column()
    verdict = _v(p["quality_verdict"]) + (" [red](storage-only: no quality claim)[/]" if p["storage_only"] else "")
    t.add_row("verdict", verdict)
    t.add_row("tokens", f"{c['baseline_tokens']} baseline, {c['candidate_tokens']} candidate; first divergence "
              f"{c['first_divergence_index'] if c['first_divergence_index'] is not None else 'none'}")
    t.add_row("token match", f"{c['token_match_ratio']:.3f} (prefix {c['prefix_match_ratio']:.3f}), "
              f"top-1 {s['top1_match_ratio']:.3f}")
    lc = p["logit_comparison"]
    if lc:
        t.add_row("logits", f"KL mean {lc['kl_mean']:.5f}, max {lc['kl_max']:.5f}, max |dlogit| "
                  f"{lc['max_abs_logit_delta']:.3f} over {lc['steps_compared']} same-context steps")
    t.add_row("memory", f"{_pct(ps['memory_saved_pct'])} saved, {ps['compression_ratio']:.2f}x, "
              f"{ps['bits_per_element']:.2f} bits/element")
    t.add_row("throughput", f"{_f(ps['throughput_ratio'], '.2f')}x baseline decode "
              f"({ps['candidate_decode_tokens_per_second']:.1f} vs {ps['baseline_decode_tokens_per_second']:.1f} tok/s)")
    t.add_row("recommendation", f"{rec['status']}: {rec['next_step']}")
    t.add_row("cause hint", rec["cause_hint"])
    if rec.get("next_policy"):
        t.add_row("next policy", rec["next_policy"])
    out.print(t)
    out.rule("baseline text")
    out.print(p["texts"]["baseline"], markup=False, highlight=False)
    out.rule("candidate text")
    out.print(p["texts"]["candidate"], markup=False, highlight=False)
    out.rule()


def validation_md(p: dict) -> str:
    c, s, ps, rec = p["comparison"], p["step_comparison"], p["policy_summary"], p["policy_recommendation"]
    lines = [
        f"# Validation: {p['candidate']} vs {p['baseline']}" if not p["self_test"] else "# Validation self-test",
        "",
        f"- model: {p['model']}; cache mode {p['cache_mode']} (baseline {p['baseline_mode']})",
        f"- candidate policy: `{p['candidate_policy']}`; baseline `{p['baseline_policy']}`",
        f"- **verdict: {p['quality_verdict']}**" + (" (storage-only: no quality claim)" if p["storage_only"] else ""),
        "",
        "| metric | value |",
        "| --- | --- |",
        f"| first divergence index | {c['first_divergence_index']} |",
        f"| token match ratio | {c['token_match_ratio']:.4f} |",
        f"| prefix match ratio | {c['prefix_match_ratio']:.4f} |",
        f"| top-1 match ratio | {s['top1_match_ratio']:.4f} |",
    ]
    lc = p["logit_comparison"]
    if lc:
        lines += [f"| KL mean / max (nats) | {lc['kl_mean']:.6f} / {lc['kl_max']:.6f} |",
                  f"| max abs logit delta | {lc['max_abs_logit_delta']:.4f} |"]
    lines += [
        f"| memory saved | {_pct(ps['memory_saved_pct'])} |",
        f"| compression ratio | {ps['compression_ratio']:.3f}x |",
        f"| bits per element | {ps['bits_per_element']:.3f} |",
        f"| throughput ratio | {_f(ps['throughput_ratio'], '.3f')} |",
        "",
        f"Recommendation: **{rec['status']}** — {rec['next_step']}. {rec['cause_hint']}."
        + (f" Next policy to try: `{rec['next_policy']}`." if rec.get("next_policy") else ""),
        "",
        "## Baseline text", "", p["texts"]["baseline"], "", "## Candidate text", "", p["texts"]["candidate"], "",
    ]
    return "\n".join(lines)


def print_teacher_forced(p: dict) -> None:
    t = Table(title=f"teacher-forced quality ({p['source']}, {p['prefill_tokens']} prefill, {p['steps']} steps, "
              f"{p['cache_mode']})")
    for col in ("policy", "bits/el", "saved", "ppl base", "ppl cand", "KL mean", "KL max", "top-1"):
        t.add_column(col, justify="right" if col != "policy" else "left")
    for r in p["results"]:
        t.add_row(r["kv_policy"], f"{r['bits_per_element']:.2f}", _pct(r["memory_saved_pct"]),
                  f"{r['ppl_baseline']:.3f}", f"{r['ppl_candidate']:.3f}", f"{r['kl_mean']:.5f}",
                  f"{r['kl_max']:.4f}", f"{r['top1_agreement']:.3f}")
    out.print(t)


def teacher_forced_md(p: dict) -> str:
    lines = [f"# Teacher-forced quality ({p['model']}, {p['source']}, {p['prefill_tokens']} prefill tokens, "
             f"{p['steps']} steps, {p['cache_mode']})", "",
             "| policy | bits/element | saved | ppl baseline | ppl candidate | KL mean | KL max | top-1 |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in p["results"]:
        lines.append(f"| {r['kv_policy']} | {r['bits_per_element']:.2f} | {_pct(r['memory_saved_pct'])} | "
                     f"{r['ppl_baseline']:.3f} | {r['ppl_candidate']:.3f} | {r['kl_mean']:.5f} | "
                     f"{r['kl_max']:.4f} | {r['top1_agreement']:.3f} |")
    return "\n".join(lines) + "\n"


# ---- compare ------------------------------------------------------------------------------------------
def _rec_lines(rec: dict) -> list[str]:
    lines = []
    if rec["status"] == "compressed-policy":
        lines.append(f"recommended: {rec['recommended_policy']} ({rec['memory_saved_pct']:.1f}% saved, exact-match "
                     "on every prompt)")
    else:
        lines.append(f"recommended: keep {rec['recommended_policy']} (no compressed policy was exact-match); best "
                     f"risky policy: {rec['best_risky_policy']}")
    lines.append("unsafe (diverged): " + (", ".join(rec["unsafe_policies"]) or "none"))
    if rec.get("note"):
        lines.append(rec["note"])
    return lines


def _div(row: dict) -> str:
    """First divergence index per prompt ('-' = identical)."""
    return " / ".join("-" if x is None else str(x) for x in row.get("first_divergence_indices", []))


def print_compare(p: dict, summary_only: bool = False) -> None:
    if not summary_only:
        t = Table(title=f"compare-policies vs {p['baseline']} ({p['cache_mode']}, {len(p['prompts'])} prompts, "
                  f"{p['max_new_tokens']} new tokens)")
        for col in ("policy", "saved", "bits/el", "verdict", "first div", "token match", "top-1", "KL mean",
                    "tput ratio"):
            t.add_column(col, justify="left" if col in ("policy", "verdict") else "right")
        for r in p["rows"]:
            t.add_row(r["policy"], _pct(r["memory_saved_pct"]), _f(r["bits_per_element"], ".2f"), _v(r["verdict"]),
                      _div(r),
                      _f(r["token_match_ratio"], ".3f"), _f(r["top1_match_ratio"], ".3f"), _f(r["kl_mean"], ".5f"),
                      _f(r["throughput_ratio"], ".2f"))
        out.print(t)
    for line in _rec_lines(p["recommendation"]):
        out.print(line, markup=False, highlight=False)


def compare_md(p: dict) -> str:
    lines = [f"# compare-policies vs {p['baseline']} ({p['model']}, {p['cache_mode']}, {len(p['prompts'])} prompts, "
             f"{p['max_new_tokens']} new tokens)", "",
             "| policy | saved | bits/element | verdict | first divergence | token match | top-1 | KL mean | "
             "throughput ratio |",
             "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in p["rows"]:
        lines.append(f"| {r['policy']} | {_pct(r['memory_saved_pct'])} | {_f(r['bits_per_element'], '.2f')} | "
                     f"{r['verdict']} | {_div(r)} | {_f(r['token_match_ratio'], '.3f')} | {_f(r['top1_match_ratio'], '.3f')} | "
                     f"{_f(r['kl_mean'], '.5f')} | {_f(r['throughput_ratio'], '.2f')} |")
    lines += [""] + [f"- {x}" for x in _rec_lines(p["recommendation"])]
    return "\n".join(lines) + "\n"


# ---- niah ---------------------------------------------------------------------------------------------
def print_niah(p: dict) -> None:
    for pol in [p["baseline"], *p["policies"]]:
        t = Table(title=f"needle in a haystack: {pol} ({p['cache_mode']})")
        t.add_column("length \\ depth", justify="right")
        for d in p["depths"]:
            t.add_column(f"{d:g}", justify="center")
        for n, row in zip(p["lengths"], p["recall"][pol]):
            t.add_row(str(n), *("[green]yes[/]" if x else "[red]no[/]" for x in row))
        out.print(t)
    t = Table(title="recall summary")
    for col in ("policy", "recall", "mean score", "agrees with baseline"):
        t.add_column(col)
    for r in p["summary"]:
        t.add_row(r["policy"], f"{r['recall']:.2f}", f"{r['mean_score']:.2f}", f"{r['agreement_with_baseline']:.2f}")
    out.print(t)


def niah_md(p: dict) -> str:
    lines = [f"# Needle in a haystack ({p['model']}, {p['cache_mode']})", ""]
    for pol in [p["baseline"], *p["policies"]]:
        lines += [f"## {pol}", "", "| length \\ depth | " + " | ".join(f"{d:g}" for d in p["depths"]) + " |",
                  "| ---: |" + " :---: |" * len(p["depths"])]
        for n, row in zip(p["lengths"], p["recall"][pol]):
            lines.append(f"| {n} | " + " | ".join("yes" if x else "no" for x in row) + " |")
        lines.append("")
    lines += ["| policy | recall | mean score | agreement with baseline |", "| --- | ---: | ---: | ---: |"]
    lines += [f"| {r['policy']} | {r['recall']:.2f} | {r['mean_score']:.2f} | {r['agreement_with_baseline']:.2f} |"
              for r in p["summary"]]
    return "\n".join(lines) + "\n"


# ---- scan ---------------------------------------------------------------------------------------------
def print_scan(p: dict, summary_only: bool = False) -> None:
    cap = p["capture"]
    t = Table(title=f"scan: {cap['model']}, {cap['tokens']} tokens, {len(p['layers'])} layers x {p['kv_heads']} KV "
              f"heads ({p['seconds']:.1f} s); thresholds " + ", ".join(f"{k}<={v}" if k != "score_cosine" else
                                                                        f"{k}>={v}" for k, v in p["thresholds"].items()))
    t.add_column("layer", justify="right")
    t.add_column("K norm", justify="right")
    t.add_column("V norm", justify="right")
    t.add_column("K outliers", justify="right")
    if not summary_only:
        for c in p["codecs"]:
            t.add_column(f"{c} KL", justify="right")
    t.add_column("cheapest")
    for i, v in enumerate(p["verdicts"]):
        kn = max(p["norms"]["k_norm"][i])
        vn = max(p["norms"]["v_norm"][i])
        ko = sum(len(x) for x in p["norms"]["k_outlier_channels"][i])
        cells = [str(v["layer"]), f"{kn:.1f}", f"{vn:.2f}", str(ko)]
        if not summary_only:
            cells += [_f(max(p["metrics"]["softmax_kl"][c][i]), ".4f") for c in p["codecs"]]
        cells.append(v["cheapest"] or "[red]none (sensitive)[/]")
        t.add_row(*cells)
    out.print(t)
    ch = p["cheapest"]
    out.print(f"codec meeting the thresholds on every layer: {ch['all_layers'] or 'none'}", markup=False)
    out.print(f"suggested policy: {p['suggested_policy']}", markup=False, highlight=False)


def scan_md(p: dict) -> str:
    cap = p["capture"]
    lines = [f"# KV scan: {cap['model']} ({cap['tokens']} tokens, {len(p['layers'])} layers x {p['kv_heads']} KV heads)",
             "", "Worst-head softmax KL per layer and codec; thresholds: "
             + ", ".join(f"{k}={v}" for k, v in p["thresholds"].items()), "",
             "| layer | " + " | ".join(p["codecs"]) + " | cheapest |",
             "| ---: |" + " ---: |" * len(p["codecs"]) + " --- |"]
    for i, v in enumerate(p["verdicts"]):
        lines.append(f"| {v['layer']} | " + " | ".join(f"{max(p['metrics']['softmax_kl'][c][i]):.4f}"
                                                      for c in p["codecs"]) + f" | {v['cheapest'] or 'none'} |")
    lines += ["", f"Suggested policy: `{p['suggested_policy']}`", ""]
    return "\n".join(lines)


# ---- kv-estimate --------------------------------------------------------------------------------------
def _bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def print_kv_estimate(p: dict) -> None:
    m = p["model"]
    title = (f"kv-estimate: {m['name']} ({m['num_layers']} layers, {m['kv_heads']} KV heads, head_dim {m['head_dim']}"
             + (f", {m['sliding_layers']} sliding layers of {m['sliding_window']}" if m["sliding_layers"] else "")
             + f"), {p['seq_len']} tokens, batch {p['batch']}")
    t = Table(title=title)
    cols = ["policy", "KV bytes", "", "fp16 bytes", "bits/el", "saved"]
    if p["memory_budget_bytes"] is not None:
        cols.append(f"max tokens in {_bytes(p['memory_budget_bytes'])}")
    for col in cols:
        t.add_column(col, justify="left" if col == "policy" else "right")
    for r in p["rows"]:
        cells = [r["kv_policy"], str(r["total_bytes"]), _bytes(r["total_bytes"]), str(r["dense_fp16_bytes"]),
                 f"{r['bits_per_element']:.3f}", _pct(r["saved_pct"])]
        if p["memory_budget_bytes"] is not None:
            cells.append(str(r["max_seq_len_in_budget"]) + (" (model max)" if r["capped_by_model_context"] else ""))
        t.add_row(*cells)
    out.print(t)
    for r in p["rows"]:
        if r.get("note"):
            out.print(f"note ({r['kv_policy']}): {r['note']}", markup=False)


def kv_estimate_md(p: dict) -> str:
    m = p["model"]
    lines = [f"# KV estimate: {m['name']}, {p['seq_len']} tokens, batch {p['batch']}", "",
             "| policy | KV bytes | fp16 bytes | bits/element | saved |" +
             (" max tokens in budget |" if p["memory_budget_bytes"] is not None else ""),
             "| --- | ---: | ---: | ---: | ---: |" + (" ---: |" if p["memory_budget_bytes"] is not None else "")]
    for r in p["rows"]:
        lines.append(f"| {r['kv_policy']} | {r['total_bytes']} | {r['dense_fp16_bytes']} | {r['bits_per_element']:.3f} "
                     f"| {_pct(r['saved_pct'])} |" + (f" {r['max_seq_len_in_budget']} |"
                                                     if p["memory_budget_bytes"] is not None else ""))
    return "\n".join(lines) + "\n"


def print_models(rows: list[dict]) -> None:
    t = Table(title="shipped model configs (kv-estimate --model NAME)")
    for col in ("name", "layers", "KV heads", "head_dim", "sliding", "max context"):
        t.add_column(col)
    for r in rows:
        t.add_row(r["name"], str(r["num_layers"]), str(r["kv_heads"]), str(r["head_dim"]),
                  f"{r['sliding_layers']} x {r['sliding_window']}" if r["sliding_layers"] else "-", str(r["max_context"]))
    out.print(t)
