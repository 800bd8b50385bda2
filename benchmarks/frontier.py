"""The KL-vs-bits frontier: allocated policies against the uniform presets, on texts the allocator did not see.

Each policy is measured by the engine's ``frontier`` (teacher-forced: prefill, then single-token steps, KL of the
next-token distributions against a dense baseline; bits per element exact at --context tokens, and the
policy's own cache report after a real prefill of that many tokens). For every allocated policy the table
names the best uniform preset of no more bytes and whether the allocation is at or below its KL.

    python benchmarks/frontier.py --allocated tqbench/data/policies/smollm2-alloc-2.5bit.toml,... \\
        --texts rivers --reuse benchmarks/results/quality-rivers.json --json benchmarks/results/frontier-smollm2.json

Points already measured with the same engine function, text, prefill and steps are reused instead of measured
again (the machine is shared and a teacher-forced run costs minutes under load): an allocation's own
``[verified]`` table (``allocate`` verifies on the same settings), and ``--reuse`` JSON files written by
``benchmarks/quality.py`` (their bits are at prefill + steps tokens, so bits are recomputed at --context with
``estimate_kv``, exact to the byte), or earlier frontier.py files (rows measured at the same context). Each
row says where its numbers came from.

Pure quantization, pure eviction and joint policies side by side (issue 32): each row's ``axis`` says which it is
(``bits``: every row kept, codecs; ``tokens``: fp16 rows, some evicted; ``joint``: both), ``--eviction`` adds pure
eviction policies (e.g. ``fp16,keep=0.5``), and for an artifact the row carries its fitted KL (the joint chunk KL
on the calibration sequences) and ``unseen_over_fitted`` (this text's KL over it). For every evicting row the table
also names the best non-evicting row (uniform or allocated) of no more bytes and the KL ratio to it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from _common import cpu_model, write_json
from rich.console import Console
from rich.table import Table

from tqbench.engine.allocate import frontier
from tqbench.engine.cache.estimate import estimate_kv
from tqbench.engine.engine import Engine
from tqbench.engine.policy import is_policy_artifact, load_policy_artifact, parse_policy, split_policies
from tqbench.engine.policy.spec import DENSE_SPECS

UNIFORM = ["turbo2", "turbo2.5", "k3v2", "turbo3", "k4v2", "turbo3.5", "turbo4", "q8k-int4v", "q8k-turbo4v"]


def axis(policy) -> str:
    """``bits`` (codecs, every row kept), ``tokens`` (fp16 rows, some evicted) or ``joint`` (both)."""
    pol = parse_policy(policy)
    if not pol.evicts:
        return "bits"
    lossy = [pol.k, pol.v, *(o[2] for o in pol.overrides if o[0] != "keep")]
    return "joint" if any(c not in DENSE_SPECS for c in lossy) else "tokens"


def _label(text: str) -> str:
    return text if ":" in text else f"corpus:{text}"


def _reused(pol: str, kind: str, text: str, args, engine, reuse: list[dict]) -> dict | None:
    """A point measured before on the same settings, or None."""
    if pol.endswith(".toml") and is_policy_artifact(pol):
        art = load_policy_artifact(pol)
        for v, where in ((art.verified, "verified"), ((art.verified or {}).get("unseen"), "verified.unseen")):
            if v and (v["text"], v["prefill_tokens"], v["steps"], v["context_tokens"]) == \
                    (_label(text), args.prefill, args.steps, args.context):
                return {k: x for k, x in v.items() if k != "unseen"} | {"kind": kind, "source": f"{pol} [{where}]"}
        return None
    label = parse_policy(pol).label
    for data in reuse:
        if isinstance(data.get("results"), dict):  # an earlier frontier.py file: rows at the same context
            if data.get("context") != args.context:
                continue
            for r in data["results"].get(text, []):
                if r["kv_policy"] == label and (r["prefill_tokens"], r["steps"]) == (args.prefill, args.steps) \
                        and r["source"] == "measured":
                    keep = {k: v for k, v in r.items() if k not in ("best_uniform_no_more_bytes",
                                                                     "at_or_below_best_uniform")}
                    return keep | {"kind": kind, "source": f"measured (reused from {data['command'].split()[-1]})"}
            continue
        for r in data.get("rows", []):  # benchmarks/quality.py: bits at prefill + steps tokens
            if r.get("text") == text and r["kv_policy"] == label and \
                    (r["prefill_tokens"], r["steps"]) == (args.prefill, args.steps):
                est = estimate_kv(parse_policy(pol), engine.geometry, args.context)
                return {"kv_policy": r["kv_policy"], "text": f"corpus:{text}", "context_tokens": args.context,
                        "bits_per_element": est.bits_per_element, "report_bits_per_element": None,
                        "report_bytes": None, "prefill_tokens": r["prefill_tokens"], "steps": r["steps"],
                        "kl_mean": r["kl_mean"], "kl_max": r["kl_max"], "top1_agreement": r["top1_agreement"],
                        "ppl_baseline": r["ppl_baseline"], "ppl_candidate": r["ppl_candidate"],
                        "ppl_delta": r["ppl_candidate"] - r["ppl_baseline"], "kind": kind,
                        "source": f"{data['command'].split()[-1]} (bits at {args.context} by estimate_kv)"}
    return None


def _axis_of(row: dict, policies: list[tuple[str, str]]) -> str:
    """The axis of a row (by its label: an artifact's policy string, or the policy as given)."""
    for pol, _ in policies:
        if pol.endswith(".toml") and is_policy_artifact(pol):
            art = load_policy_artifact(pol)
            if art.policy.label == row["kv_policy"]:
                return axis(art.policy.to_string())
        elif parse_policy(pol).label == row["kv_policy"]:
            return axis(pol)
    return "bits"


def policy_list(text: str) -> list[str]:
    """Policies separated by ";", or by "," between names (``tqbench.engine.split_policies``: one rule)."""
    return split_policies(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--allocated", required=True, help="policy artifacts (.toml) or names, comma-separated (or ;-separated)")
    ap.add_argument("--uniform", default=",".join(UNIFORM), help="uniform presets, comma-separated; ;-separated when a compact policy holds commas")
    ap.add_argument("--eviction", default="", help="pure eviction policies, ;-separated (e.g. 'fp16,keep=0.5;fp16,keep=0.25')")
    ap.add_argument("--texts", default="rivers", help="comma-separated shipped corpus texts (not the calibration text)")
    ap.add_argument("--prefill", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--reuse", default=None, help="comma-separated benchmarks/quality.py JSON files to reuse")
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    console = Console(width=220)
    engine = Engine.load(args.model, threads=args.threads)
    allocated = policy_list(args.allocated)
    uniform = policy_list(args.uniform)
    eviction = policy_list(args.eviction) if args.eviction else []
    policies = [(p, "allocated") for p in allocated] + [(p, "uniform") for p in uniform] + \
        [(p, "eviction") for p in eviction]
    fitted = {}  # an artifact's label -> its fitted KL (the joint chunk KL on the calibration sequences)
    for p in allocated:
        if p.endswith(".toml") and is_policy_artifact(p):
            art = load_policy_artifact(p)
            fitted[art.policy.label] = art.allocation.get("predicted_kl")
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    results = {}
    reuse = [json.loads(Path(f).read_text()) for f in (args.reuse.split(",") if args.reuse else [])]
    for text in args.texts.split(","):
        rows, todo = [], []
        for pol, kind in policies:
            row = _reused(pol, kind, text, args, engine, reuse)
            if row is None:
                todo.append((pol, kind))
            else:
                rows.append(row)
        if todo:
            pts = frontier(engine, [p for p, _ in todo], text=text, prefill=args.prefill, steps=args.steps,
                           context=args.context)
            rows += [p.to_dict() | {"kind": kind, "source": "measured"} for p, (_, kind) in zip(pts, todo)]
        for r in rows:
            r["axis"] = _axis_of(r, policies)
            if r["kv_policy"] in fitted and fitted[r["kv_policy"]]:
                r["fitted_kl"] = fitted[r["kv_policy"]]
                r["unseen_over_fitted"] = r["kl_mean"] / r["fitted_kl"]
        results[text] = rows
        table = Table(title=f"frontier on {text}: {args.prefill} prefill + {args.steps} teacher-forced steps, "
                            f"bits at {args.context} tokens")
        for col in ("policy", "kind", "axis", "bits/el", "KL", "top-1", "ppl delta", "best uniform <= bytes", "its KL",
                    "at/below", "best no-evict <= bytes", "KL / it", "unseen/fitted", "source"):
            table.add_column(col, justify="left" if col in ("policy", "kind", "axis", "best uniform <= bytes",
                                                            "best no-evict <= bytes") else "right")
        uni = [r for r in results[text] if r["kind"] == "uniform"]
        keepall = [r for r in results[text] if r["axis"] == "bits"]
        for r in sorted(results[text], key=lambda r: r["bits_per_element"]):
            cheaper = [u for u in uni if u["bits_per_element"] <= r["bits_per_element"] + 1e-9]
            best = min(cheaper, key=lambda u: u["kl_mean"]) if cheaper and r["kind"] == "allocated" else None
            if best is not None:
                r["best_uniform_no_more_bytes"] = best["kv_policy"]
                r["at_or_below_best_uniform"] = r["kl_mean"] <= best["kl_mean"]
            quant = None
            if r["axis"] != "bits":
                cands = [u for u in keepall if u["bits_per_element"] <= r["bits_per_element"] + 1e-9]
                quant = min(cands, key=lambda u: u["kl_mean"]) if cands else None
                if quant is not None:
                    r["best_no_eviction_no_more_bytes"] = quant["kv_policy"]
                    r["kl_over_best_no_eviction"] = r["kl_mean"] / quant["kl_mean"] if quant["kl_mean"] else None
            ratio = r.get("kl_over_best_no_eviction")
            table.add_row(r["kv_policy"], r["kind"], r["axis"], f"{r['bits_per_element']:.3f}", f"{r['kl_mean']:.4f}",
                          f"{r['top1_agreement']:.3f}", f"{r['ppl_delta']:+.3f}",
                          best["kv_policy"] if best else "", f"{best['kl_mean']:.4f}" if best else "",
                          ("yes" if r["at_or_below_best_uniform"] else "NO") if best else "",
                          quant["kv_policy"] if quant else "", f"{ratio:.2f}" if ratio is not None else "",
                          f"{r['unseen_over_fitted']:.2f}" if "unseen_over_fitted" in r else "", r["source"])
        console.print(table)
    payload = {
        "command": " ".join([sys.executable.split("/")[-1], *sys.argv]), "model": engine.name,
        "threads": torch.get_num_threads(), "cpu": cpu_model(), "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(), "seconds": round(time.perf_counter() - t0, 1),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "prefill": args.prefill,
        "steps": args.steps, "context": args.context, "results": results,
    }
    write_json(args.json, payload, console)


if __name__ == "__main__":
    main()
