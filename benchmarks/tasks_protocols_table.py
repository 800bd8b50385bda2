"""The query-agnostic vs query-aware table: reads ``tqbench --headless tasks --json`` results (one candidate, one or
both protocols each; ``benchmarks/run_tasks_protocols.sh`` writes them) and prints one Markdown row per (candidate,
protocol): compression, overall score with its 95% interval, the baseline's, the delta, samples, and the KVzip
pass's mean seconds. ``--json`` writes the rows.

    python benchmarks/tasks_protocols_table.py benchmarks/results/tasks/protocols-2048-*.json --json out.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def rows_of(path: Path) -> list[dict]:
    text = path.read_text(encoding="utf-8")
    if not text.strip():
        return []
    d = json.loads(text[text.index("{"):])
    out = []
    for proto, o in d.get("overall_by_protocol", {"aware": d["overall"]}).items():
        board = [r for r in d["leaderboard"] if r["task"] == "overall" and r.get("protocol", "aware") == proto]
        cr = next(r["compression_ratio"] for r in board if r["method"] == d["candidate"])
        ss = [s for s in d["samples"] if s.get("protocol", "aware") == proto]
        passes = [s.get("candidate_context_pass_seconds", 0.0) for s in ss]
        out.append({"file": path.name, "candidate": d["candidate"], "protocol": proto, "context": d["context"],
                    "compression_ratio": cr, "x_smaller": round(1 / (1 - cr), 2) if cr < 1 else None,
                    "candidate_score": round(o["candidate_score"], 1), "candidate_ci": o["candidate_ci"],
                    "baseline_score": round(o["baseline_score"], 1), "baseline_ci": o["baseline_ci"],
                    "delta": round(o["delta"], 1), "samples": o["samples"], "tasks": d["tasks"] and
                    [t["task"] for t in d["tasks"] if t["protocol"] == proto],
                    "context_pass_seconds_mean": round(sum(passes) / len(passes), 1) if passes else 0.0})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    rows = [r for f in args.files for r in rows_of(f)]
    print("| candidate | protocol | x smaller | score [95%] | fp16 [95%] | delta | samples | KVzip pass s |")
    print("| --- | --- | ---: | --- | --- | ---: | ---: | ---: |")
    for r in rows:
        lo, hi = r["candidate_ci"]
        blo, bhi = r["baseline_ci"]
        print(f"| `{r['candidate']}` | {r['protocol']} | {r['x_smaller']} | {r['candidate_score']} [{lo:.0f}-{hi:.0f}] "
              f"| {r['baseline_score']} [{blo:.0f}-{bhi:.0f}] | {r['delta']:+.1f} | {r['samples']} "
              f"| {r['context_pass_seconds_mean'] or ''} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
