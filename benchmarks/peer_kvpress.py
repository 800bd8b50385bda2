"""tqbench's eviction policies beside NVIDIA kvpress's presses on the same prompts and model, both protocols, at
kvpress's leaderboard ratios (``docs/validation.md``, "Beside kvpress"). kvpress runs in its own venv
(``make kvpress-env``) as a subprocess; tqbench keeps ``keep = 1 - ratio``.

    nice -n 10 python benchmarks/peer_kvpress.py --context 2048 --samples 2 --threads 1 --out out/peer
    python benchmarks/peer_kvpress.py --report --out out/peer      # the table, leaderboard folders and plot only

Each tqbench candidate's result is one line of ``OUT/tqbench-<context>.jsonl`` (a rerun skips the ones there);
kvpress's answers are ``OUT/kvpress-<context>.jsonl`` (the runner's JSON lines, resumable the same way by
sample). ``--report`` merges both into ``OUT/side-by-side-<context>.json`` / ``.md``, the kvpress leaderboard
folders (``OUT/leaderboard/``) and the score-vs-ratio plot (``OUT/score-vs-ratio-<context>.svg``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import _common  # noqa: F401  (puts the checkout first on sys.path)

TEMPLATES = ("score=kvzip", "score=snapkv", "score=tova", "chunk=8")


def _lines(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line cut by a kill
    return out


def measure(args, out: Path) -> None:
    from tqbench.engine.engine import Engine
    from tqbench.engine.tasks import prepare_suite, score_candidate
    from tqbench.engine.tasks.peer import build_request, check_presses, peer_python, run_peer

    engine = Engine.load(args.model, threads=args.threads)
    tasks = args.tasks.split(",") if args.tasks else None
    suite = prepare_suite(engine, args.context, tasks=tasks, samples=args.samples, cache_mode=args.cache_mode)
    ratios = [float(r) for r in args.ratios.split(",")]
    protocols = ("agnostic", "aware")
    # sample-major on both sides (pass k: the k-th sample of every task), so a run cut short still compares every
    # method on the same complete passes
    passes = sorted({s.index for s in suite.samples})
    order = sorted(range(len(suite.samples)), key=lambda i: (suite.samples[i].index, i))
    suite.samples[:] = [suite.samples[i] for i in order]
    suite.answers[:] = [suite.answers[i] for i in order]
    peer = None
    if not args.skip_peer:
        path = out / f"kvpress-{args.context}.jsonl"
        done = {(a["sample"], a["protocol"], a["press"], a["ratio"]) for a in _lines(path) if a.get("event") == "answer"}
        req = build_request(engine, suite, check_presses(args.presses), ratios, protocols, threads=args.threads)
        req["samples"] = [s for s in req["samples"] if not all(
            (s["id"], p, press, r) in done for p in protocols for press in req["presses"]
            for r in ([0.0] if press == "none" else ratios))]
        if req["samples"]:
            if args.peer_background:  # the runner's own lines straight into the file, beside tqbench's passes
                import subprocess

                from tqbench.engine.tasks.peer.client import RUNNER

                fh = path.open("a", encoding="utf-8")
                peer = subprocess.Popen([str(peer_python()), "-I", str(RUNNER)], stdin=subprocess.PIPE, stdout=fh,
                                        stderr=subprocess.DEVNULL, text=True)
                peer.stdin.write(json.dumps(req))
                peer.stdin.close()
            else:
                res = run_peer(req, peer_python(), on_event=lambda e: print(f"{time.strftime('%H:%M:%S')} "
                                                                             f"{e.message}", flush=True))
                with path.open("a", encoding="utf-8") as fh:
                    for a in res["answers"]:
                        fh.write(json.dumps({"event": "answer", **a}) + "\n")
                    fh.write(json.dumps({"event": "result", "versions": res.get("versions", {})}) + "\n")
    if not args.skip_tqbench:
        path = out / f"tqbench-{args.context}.jsonl"
        have = {(d["candidate"], d.get("pass")) for d in _lines(path)}
        for k in passes:
            part = dataclasses.replace(suite, samples=[s for s in suite.samples if s.index == k],
                                       answers=[a for s, a in zip(suite.samples, suite.answers) if s.index == k])
            for r in ratios:
                for t in args.templates.split(";"):
                    cand = engine.check_policy(f"fp16,keep={1 - r:g},{t}").label
                    if (cand, k) in have:
                        continue
                    t0, load0 = time.time(), os.getloadavg()
                    print(f"{time.strftime('%H:%M:%S')} pass {k}: {cand} load {load0[0]:.1f}", flush=True)
                    d = score_candidate(engine, part, cand, protocols=protocols).to_dict()
                    d.update(ratio=r, seconds=round(time.time() - t0, 1), threads=args.threads, loadavg_before=load0,
                             loadavg_after=os.getloadavg(), **{"pass": k})
                    with path.open("a", encoding="utf-8") as fh:
                        fh.write(json.dumps(d) + "\n")
    if peer is not None:
        peer.wait()


def report(args, out: Path) -> None:
    from tqbench.engine.tasks.peer.rows import side_by_side_from_files, write_leaderboard

    sbs = side_by_side_from_files(_lines(out / f"tqbench-{args.context}.jsonl"),
                                  _lines(out / f"kvpress-{args.context}.jsonl"))
    meta = {"command": " ".join([os.path.basename(sys.executable), *sys.argv]), "threads": args.threads,
            "loadavg_at_report": os.getloadavg()}
    (out / f"side-by-side-{args.context}.json").write_text(json.dumps({**meta, **sbs}, indent=1), encoding="utf-8")
    from tqbench.cli.render.peer import plot_svg, side_by_side_md

    (out / f"side-by-side-{args.context}.md").write_text(side_by_side_md(sbs), encoding="utf-8")
    (out / f"score-vs-ratio-{args.context}.svg").write_text(plot_svg(sbs), encoding="utf-8")
    write_leaderboard(sbs, out / "leaderboard")
    print(side_by_side_md(sbs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--tasks", default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cache-mode", default="compressed")
    ap.add_argument("--ratios", default="0.25,0.5,0.75,0.875")
    ap.add_argument("--templates", default=";".join(TEMPLATES), help="';'-separated policy keys beside keep")
    ap.add_argument("--presses", default="none,snapkv,tova,kvzip,expected,knorm,chunkkv")
    ap.add_argument("--skip-peer", action="store_true")
    ap.add_argument("--peer-background", action="store_true",
                    help="run the peer beside tqbench's passes (two processes), its lines straight into its file")
    ap.add_argument("--skip-tqbench", action="store_true")
    ap.add_argument("--report", action="store_true", help="only merge what OUT holds")
    ap.add_argument("--out", default="out/peer")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.report:
        measure(args, out)
    report(args, out)


if __name__ == "__main__":
    main()
