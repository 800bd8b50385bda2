"""Print the measured table of ``allocate`` reports (JSON from ``tqbench --headless allocate --json``): budget,
granularity, bits, KL on the verification text and on the unseen text, their ratio, the predicted (joint
calibration) KL and its ratio to the verified one, exchange steps accepted, seconds per phase.

    python benchmarks/allocate_table.py benchmarks/results/allocate/i21/head-*.json [--markdown]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def rows(paths: list[str]) -> list[dict]:
    out = []
    for p in paths:
        text = Path(p).read_text(encoding="utf-8").strip()
        if not text:
            continue
        d = json.loads(text)
        fv, a, s = d.get("fitted_vs_unseen") or {}, d["allocation"], d.get("seconds", {})
        steps = d.get("steps", [])
        out.append({
            "file": p, "budget": a["budget_bits"], "granularity": d["setup"].get("granularity", "layer"),
            "bits": a["bits_per_element"], "kl_verify": fv.get("verification_kl"), "kl_unseen": fv.get("unseen_kl"),
            "unseen_over_verify": fv.get("unseen_over_verification"), "predicted": fv.get("predicted_kl"),
            "predicted_over_verify": fv.get("predicted_over_verification"), "additive": fv.get("additive_kl"),
            "accepted": sum(1 for x in steps if x.get("kind") == "exchange" and x.get("accepted")),
            "exchange_steps": sum(1 for x in steps if x.get("kind") == "exchange"),
            "sink_recent": next((f"{x['sink']}/{x['recent']}" for x in steps if x.get("kind") == "protection"
                                 and x.get("accepted")), None),
            "seconds": s,
        })
    return out


def fmt(v, spec: str) -> str:
    return "" if v is None else format(v, spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("reports", nargs="+")
    args = ap.parse_args()
    print("| budget | granularity | bits/el | KL rivers | KL unseen | unseen/rivers | predicted | predicted/rivers "
          "| additive | exchange accepted | sink/recent | cells + solve + verify (s) |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |")
    for r in sorted(rows(args.reports), key=lambda r: (r["granularity"], r["budget"])):
        s = r["seconds"]
        print(f"| {r['budget']:g} | {r['granularity']} | {r['bits']:.3f} | {fmt(r['kl_verify'], '.4f')} | "
              f"{fmt(r['kl_unseen'], '.4f')} | {fmt(r['unseen_over_verify'], '.2f')} | {fmt(r['predicted'], '.4f')} | "
              f"{fmt(r['predicted_over_verify'], '.2f')} | {fmt(r['additive'], '.4f')} | "
              f"{r['accepted']}/{r['exchange_steps']} | {r['sink_recent'] or ''} | "
              f"{round(s['setup'] + s['sensitivity'], 2) if 'setup' in s else s.get('sensitivity', '')} + "
              f"{s.get('solve_and_measure', '')} + {s.get('verify', '')} |")


if __name__ == "__main__":
    main()
