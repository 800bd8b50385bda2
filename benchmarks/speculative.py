"""Prompt-lookup decoding with a compressed cache: its tokens against plain greedy decoding, per policy and mode.

``python benchmarks/speculative.py [--model default] [--dtype float32] [--policies turbo4] [--modes compressed,fused]
[--lookup 8] [--new-tokens 64] [--threads 1]``

For each prompt (three kinds: editing code, continuing a list, answering about a quoted passage) and each
policy x mode, greedy decoding runs twice through ``Engine.generate``: plain, and with ``prompt_lookup``. It
prints the token agreement (exact match, first divergence, share of equal tokens), the drafts accepted, and the
decode time ratio speculative / plain (same process, same prompt), and writes the rows as JSON. In float64 the
tokens must be equal (the tests check it); in fp32 a draft verified in one call sums in another order than a
one-token call, and near-ties can flip a token: this script measures how often.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
from pathlib import Path

from _common import cpu_model, write_json

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPTS = {
    "code": ("Rename the variable `total` to `running_sum` in this function and return the whole function:\n\n"
             "def mean(values):\n    total = 0\n    count = 0\n    for v in values:\n        total += v\n"
             "        count += 1\n    if count == 0:\n        return 0.0\n    return total / count\n"),
    "list": ("Here is a list: cat, dog, horse, cow, sheep, goat, pig, duck, goose, hen. Write the list again, "
             "then add three more farm animals."),
    "quote": ("The passage: 'A lighthouse keeper on a remote island kept a logbook for forty years. Every evening "
              "he wrote down the direction of the wind, the state of the sea, and the ships that passed.' "
              "Quote the sentence about the logbook, then say in one sentence why it matters."),
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--policies", default="turbo4")
    p.add_argument("--modes", default="compressed,fused")
    p.add_argument("--lookup", type=int, default=8, help="most draft tokens per verification call")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "speculative.json"))
    a = p.parse_args(argv)

    from tqbench.engine.engine import Engine

    eng = Engine.tiny() if a.model == "tiny" else Engine.load(a.model, device="cpu", dtype=a.dtype, threads=a.threads)
    rows = []
    print(f"{'policy':<10} {'mode':<11} {'prompt':<6} {'exact':>5} {'first diff':>10} {'match':>6} "
          f"{'accepted':>8} {'drafted':>7} {'time ratio':>10}")
    for policy in a.policies.split(","):
        for mode in a.modes.split(","):
            for name, text in PROMPTS.items():
                ids = eng.encode_prompt(text)
                kw = dict(max_new_tokens=a.new_tokens, stop_at_eos=False)
                plain = eng.generate(ids, policy, mode, **kw)
                spec = eng.generate(ids, policy, mode, prompt_lookup=a.lookup, **kw)
                x, y = plain.token_ids, spec.token_ids
                first = next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), None)
                row = {"policy": policy, "mode": mode, "prompt": name, "exact": x == y,
                       "first_divergence": first, "token_match": sum(s == t for s, t in zip(x, y)) / len(x),
                       **spec.speculation.to_dict(),
                       "decode_time_ratio": round(spec.decode_seconds / plain.decode_seconds, 3)}
                rows.append(row)
                print(f"{policy:<10} {mode:<11} {name:<6} {str(row['exact']):>5} {str(first):>10} "
                      f"{row['token_match']:>6.3f} {row['accepted']:>8} {row['drafted']:>7} "
                      f"{row['decode_time_ratio']:>10.3f}")
    load = os.getloadavg()
    print(f"threads {a.threads}, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, {cpu_model()}")
    write_json(a.json, {"benchmark": "speculative", "date": datetime.datetime.now(datetime.UTC).isoformat(),
                        "model": eng.name, "dtype": a.dtype, "lookup": a.lookup, "new_tokens": a.new_tokens,
                        "threads": a.threads, "load_average": load, "cpu": cpu_model(),
                        "python": platform.python_version(), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
