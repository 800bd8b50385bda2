"""lm-evaluation-harness accuracy of KV policies through ``tqbench serve``: one log-likelihood task, per policy.

``python benchmarks/lm_eval_policies.py [--model default] [--policies fp16,turbo4] [--prefill-chunks 0,16]``
spawns ``tqbench serve --kv-policy P --prefill-chunk C`` for every pair (``serve.py``'s spawner), runs
``python -m lm_eval --model local-completions`` on the local task ``tqbench_mc`` (tests/data/lm_eval: 40
four-way questions, 3-shot, contexts of 50-90 tokens; no hub), stops the server, and prints accuracy, the
mean |delta log-likelihood| of every (question, choice) against the first policy at the same chunk size, and
how many questions changed their pick. Writes JSON (default ``benchmarks/results/lm-eval-policies.json``).

What the prefill sees: with ``--prefill-chunk 0`` the whole prompt is one forward call, which attends over
exact K/V, so every policy scores exactly what fp16 scores; with chunks of C tokens each call reads the
earlier calls' rows as the policy stored them, which is where a policy's cost shows.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import cpu_model, write_json
from serve import spawn_server

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "tests" / "data" / "lm_eval"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument("--policies", default="fp16,turbo4")
    p.add_argument("--prefill-chunks", default="0,16")
    p.add_argument("--task", default="tqbench_mc")
    p.add_argument("--limit", type=int, default=None, help="documents (default: all)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cache-mode", default="compressed")
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "lm-eval-policies.json"))
    a = p.parse_args(argv)
    a.policy_list = [x for x in a.policies.split(",") if x]
    a.chunk_list = [int(x) for x in a.prefill_chunks.split(",") if x]
    # what spawn_server reads
    a.max_tokens, a.max_queue, a.concurrencies, a.api_key, a.max_batch = 1, 8, [1], None, None
    return a


def run_lm_eval(a, url: str, model_name: str, out: Path) -> tuple[dict, list[dict], float]:
    cmd = [sys.executable, "-m", "lm_eval", "--model", "local-completions",
           "--model_args", f"base_url={url}/v1/completions,model={model_name},max_retries=1,timeout=600",
           "--tasks", a.task, "--include_path", str(TASKS), "--output_path", str(out), "--log_samples"]
    if a.limit:
        cmd += ["--limit", str(a.limit)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_DATASETS_CACHE": str(out / "datasets-cache")}
    import time

    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=TASKS, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"lm_eval failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    result = json.loads(sorted(out.rglob("results_*.json"))[-1].read_text())["results"][a.task]
    samples = [json.loads(x) for x in sorted(out.rglob(f"samples_{a.task}_*.jsonl"))[-1].read_text().splitlines()]
    return result, sorted(samples, key=lambda s: s["doc_id"]), seconds


def main(argv=None) -> int:
    a = parse_args(argv)
    runs = []
    load_before = os.getloadavg()
    for chunk in a.chunk_list:
        for policy in a.policy_list:
            a.prefill_chunk = chunk
            proc, url = spawn_server(a, policy)
            try:
                import http.client

                conn = http.client.HTTPConnection(url.split("//")[1].split(":")[0], int(url.rsplit(":", 1)[1]))
                conn.request("GET", "/v1/models")
                model_name = json.loads(conn.getresponse().read())["data"][0]["id"]
                conn.close()
                with tempfile.TemporaryDirectory() as tmp:
                    result, samples, seconds = run_lm_eval(a, url, model_name, Path(tmp))
            finally:
                proc.terminate()
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
            lls = [[float(r[0][0]) for r in s["resps"]] for s in samples]
            runs.append({"kv_policy": policy, "prefill_chunk": chunk, "acc": result["acc,none"],
                         "acc_stderr": result.get("acc_stderr,none"), "documents": len(samples),
                         "seconds": round(seconds, 1), "loglikelihoods": lls,
                         "picks": [max(range(len(x)), key=x.__getitem__) for x in lls]})
            print(f"  {policy} prefill_chunk={chunk}: acc {result['acc,none']:.4f} over {len(samples)} documents "
                  f"({seconds:.0f} s)", flush=True)
    for r in runs:
        base = next(b for b in runs if b["prefill_chunk"] == r["prefill_chunk"])
        deltas = [abs(x - y) for xs, ys in zip(r["loglikelihoods"], base["loglikelihoods"]) for x, y in zip(xs, ys)]
        r["vs"] = base["kv_policy"]
        r["mean_abs_delta_loglik"] = round(sum(deltas) / len(deltas), 5)
        r["max_abs_delta_loglik"] = round(max(deltas), 5)
        r["changed_picks"] = sum(p != q for p, q in zip(r["picks"], base["picks"]))
    load_after = os.getloadavg()
    header = ("policy", "prefill chunk", "acc", "stderr", "docs", f"mean |d loglik| vs {a.policy_list[0]}",
              "max |d loglik|", "changed picks")
    rows = [(r["kv_policy"], r["prefill_chunk"] or "whole prompt", f"{r['acc']:.4f}",
             f"{r['acc_stderr']:.4f}" if isinstance(r["acc_stderr"], float) else r["acc_stderr"], r["documents"],
             r["mean_abs_delta_loglik"], r["max_abs_delta_loglik"], r["changed_picks"]) for r in runs]
    widths = [max(len(str(h)), *(len(str(x[i])) for x in rows)) for i, h in enumerate(header)]
    print(f"lm-eval {a.task} through tqbench serve ({a.model}, {a.cache_mode}, {a.threads} threads)")
    print("  ".join(str(h).rjust(w) for h, w in zip(header, widths)))
    for x in rows:
        print("  ".join(str(v).rjust(w) for v, w in zip(x, widths)))
    print(f"load average {load_before[0]:.2f} -> {load_after[0]:.2f} (1 min), {cpu_model()}, {os.cpu_count()} CPUs")
    write_json(a.json, {
        "benchmark": "lm-eval-policies", "command": [sys.executable, *sys.argv],
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": a.model, "task": a.task, "cache_mode": a.cache_mode, "threads": a.threads,
        "python": platform.python_version(), "cpu": cpu_model(), "cpus": os.cpu_count(),
        "loadavg_before": list(load_before), "loadavg_after": list(load_after), "runs": runs,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
