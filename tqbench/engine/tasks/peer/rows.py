"""Every method's answers on one suite as rows side by side (tqbench's candidates and a peer's presses), and the
kvpress leaderboard's files.

A *sample row* is one answer: ``{"library", "method", "ratio", "protocol", "task", "index", "score" (0..1),
"agree" (same text as the baseline), "answer", "references"}``. ``ratio`` is kvpress's ``compression_ratio``
(the fraction of context rows removed; tqbench's ``keep = 1 - ratio``). ``side_by_side`` turns sample rows into
one row per (library, method, ratio, protocol): a score per task and overall (the mean of the task scores, as
``TasksResult`` does), its 95% interval (``spec.interval95``, over every sample) and the samples it saw. Torch-free.
"""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

from tqbench.engine.tasks.spec import SUITE, TASKS, interval95

#: the kvpress leaderboard's columns, then tqbench's additions
LEADERBOARD_COLUMNS = ("dataset", "data_dir", "model", "method", "compression_ratio", "score",
                       "library", "protocol", "ci95_low", "ci95_high", "samples")


def peer_method(peer: str, press: str) -> str:
    return f"{peer}:{press}"


def score_peer(answers: list[dict], references: dict, peer: str = "kvpress") -> list[dict]:
    """The peer's answers (the runner's ``answers``) as sample rows, scored by the suite's own metric.
    ``references``: ``{"task#index": (references, baseline answer)}``; an answer to a sample not there is skipped."""
    rows = []
    for a in answers:
        sid = a.get("sample", "")
        if sid not in references:
            continue
        task, index = sid.rsplit("#", 1)
        refs, base = references[sid]
        text = str(a.get("text", ""))
        rows.append({"library": peer, "method": peer_method(peer, a["press"]), "press": a["press"],
                     "ratio": round(float(a["ratio"]), 6), "protocol": a["protocol"], "task": task,
                     "index": int(index), "score": TASKS[task].score(text, tuple(refs)),
                     "agree": text.strip() == str(base).strip(), "answer": text, "references": list(refs),
                     "context_tokens": a.get("context_tokens"), "cache_rows": a.get("cache_rows"),
                     "seconds": a.get("seconds")})
    return rows


def references_of(result: dict) -> dict:
    """``{"task#index": (references, baseline answer)}`` from a ``TasksResult.to_dict()``."""
    return {f"{s['task']}#{s['index']}": (tuple(s["references"]), s["baseline_answer"]) for s in result["samples"]}


def tqbench_samples(result: dict, ratio: float | None = None) -> list[dict]:
    """A ``TasksResult.to_dict()``'s candidate answers as sample rows (and the baseline's, once, ratio 0, under
    the method ``baseline``). ``ratio``: the candidate's nominal compression ratio (``1 - keep``); None: the
    measured one (the fraction of fp16 KV bytes not stored)."""
    rows, seen = [], set()
    for s in result["samples"]:
        r = s["candidate_compression_ratio"] if ratio is None else ratio
        common = {"protocol": s.get("protocol", "aware"), "task": s["task"], "index": s["index"],
                  "references": list(s["references"])}
        rows.append({"library": "tqbench", "method": result["candidate"], "ratio": round(float(r), 6),
                     "score": s["candidate_score"], "agree": s["agree"], "answer": s["candidate_answer"],
                     "measured_compression_ratio": s["candidate_compression_ratio"], **common})
        key = (s["task"], s["index"])
        if key not in seen:  # the baseline answers once (every row kept: the protocol changes nothing)
            seen.add(key)
            rows.append({"library": "tqbench", "method": f"{result['baseline']} (baseline)", "ratio": 0.0,
                         "score": s["baseline_score"], "agree": True, "answer": s["baseline_answer"],
                         **{**common, "protocol": "both"}})
    return rows


def _task_score(rows: list[dict], task: str) -> float | None:
    ss = [r["score"] for r in rows if r["task"] == task]
    return 100 * sum(ss) / len(ss) if ss else None


def side_by_side(samples: list[dict], tasks: list[str], *, dataset: str = "", model: str = "") -> dict:
    """One row per (library, method, ratio, protocol) of ``samples`` (sample rows), in ``tasks`` order; rows sorted
    by ratio, protocol, library, method. Each: ``scores`` per task, ``score`` overall, ``ci95``, ``samples``,
    ``agreement`` (with the baseline's answers, %). ``best``: per (ratio, protocol, library), its best method."""
    groups: dict[tuple, list[dict]] = {}
    for s in samples:
        groups.setdefault((s["library"], s["method"], s["ratio"], s["protocol"]), []).append(s)
    rows = []
    for (lib, method, ratio, protocol), ss in groups.items():
        scores = {t: _task_score(ss, t) for t in tasks}
        have = [v for v in scores.values() if v is not None]
        rows.append({"library": lib, "method": method, "ratio": ratio, "protocol": protocol, "scores": scores,
                     "score": sum(have) / len(have) if have else 0.0,
                     "ci95": list(interval95([s["score"] for s in ss])), "samples": len(ss),
                     "agreement": 100 * sum(bool(s["agree"]) for s in ss) / len(ss)})
    order = {"both": 0, "agnostic": 1, "aware": 2}
    rows.sort(key=lambda r: (r["ratio"], order.get(r["protocol"], 3), r["library"] != "tqbench", r["method"]))
    best: dict[str, dict] = {}
    for r in rows:
        key = f"{r['ratio']:g}|{r['protocol']}|{r['library']}"
        if key not in best or r["score"] > best[key]["score"]:
            best[key] = {"method": r["method"], "score": r["score"]}
    return {"dataset": dataset or SUITE, "model": model, "tasks": list(tasks), "rows": rows, "best": best,
            "samples": samples}


def side_by_side_from_files(results: list[dict], peer_lines: list[dict], peer: str = "kvpress") -> dict:
    """The benchmark's files merged: ``results`` (``TasksResult.to_dict()`` lines, each with its nominal ``ratio``)
    and the peer runner's JSON lines (its ``answer`` events). Only the samples every row answered are compared
    (a run cut short leaves some rows with more: those answers are left out, counted in ``answers_left_out``)."""
    if not results:
        return side_by_side([], [])
    refs: dict = {}
    for d in results:
        refs.update(references_of(d))
    samples, base = [], set()
    for d in results:  # a candidate may come in several passes (each a subset of the samples)
        for s in tqbench_samples(d, d.get("ratio")):
            if s["method"].endswith("(baseline)"):
                if (s["task"], s["index"]) in base:
                    continue
                base.add((s["task"], s["index"]))
            samples.append(s)
    answers = {(a["sample"], a["press"], a["ratio"], a["protocol"]): a for a in peer_lines if a.get("event") == "answer"}
    samples += score_peer(list(answers.values()), refs, peer)
    groups: dict[tuple, set] = {}
    for s in samples:
        groups.setdefault((s["library"], s["method"], s["ratio"], s["protocol"]), set()).add((s["task"], s["index"]))
    common = set.intersection(*groups.values()) if groups else set()
    dropped = len(samples)
    samples = [s for s in samples if (s["task"], s["index"]) in common]  # every row on the same samples
    dropped -= len(samples)
    versions = next((v.get("versions", {}) for v in reversed(peer_lines) if v.get("event") in ("result", "started")), {})
    first = results[0]
    out = side_by_side(samples, [t["task"] for t in first["tasks"] if t["protocol"] == first["protocols"][0]],
                       dataset=first["dataset"], model=first["model"])
    out.update(context=first["context"], peer_versions=versions, compared=sorted(f"{t}#{i}" for t, i in common),
               answers_left_out=dropped)
    return out


# ---- the kvpress leaderboard's files --------------------------------------------------------------------------
def leaderboard_rows(sbs: dict) -> list[dict]:
    """The side-by-side rows in kvpress's leaderboard schema (``dataset, data_dir, model, method,
    compression_ratio, score``), with the library, protocol, 95% interval and sample count beside."""
    dataset, _, data_dir = sbs["dataset"].rpartition("-")
    return [{"dataset": dataset or sbs["dataset"], "data_dir": data_dir, "model": sbs["model"],
             "method": r["method"], "compression_ratio": r["ratio"], "score": round(r["score"], 4),
             "library": r["library"], "protocol": r["protocol"], "ci95_low": r["ci95"][0], "ci95_high": r["ci95"][1],
             "samples": r["samples"]} for r in sbs["rows"]]


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._=+-]+", "_", text).strip("_")


def write_leaderboard(sbs: dict, folder: Path, config: dict | None = None) -> list[Path]:
    """kvpress's evaluation layout: one folder per run (method, ratio, protocol), each with ``config.json`` (what
    ran), ``metrics.json`` (per task and overall, with intervals) and ``predictions.csv`` (one answer a line);
    ``leaderboard.csv`` beside them (``leaderboard_rows``). Returns the run folders."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    board = leaderboard_rows(sbs)
    with (folder / "leaderboard.csv").open("w", newline="", encoding="utf-8") as fh:
        w = csv.DictWriter(fh, fieldnames=LEADERBOARD_COLUMNS)
        w.writeheader()
        w.writerows(board)
    runs = []
    for r, b in zip(sbs["rows"], board):
        run = folder / _slug(f"{b['dataset']}__{b['data_dir']}__{b['model']}__{r['method']}__"
                             f"{r['ratio']:.3f}__{r['protocol']}")
        run.mkdir(exist_ok=True)
        (run / "config.json").write_text(json.dumps({**(config or {}), **{k: b[k] for k in (
            "dataset", "data_dir", "model", "method", "compression_ratio", "library", "protocol")}},
            indent=1), encoding="utf-8")
        (run / "metrics.json").write_text(json.dumps({
            "score": round(r["score"], 4), "ci95": r["ci95"], "samples": r["samples"],
            "agreement_with_baseline": round(r["agreement"], 2),
            "tasks": {t: (None if v is None else round(v, 4)) for t, v in r["scores"].items()}}, indent=1),
            encoding="utf-8")
        mine = [s for s in sbs["samples"] if (s["library"], s["method"], s["ratio"], s["protocol"]) ==
                (r["library"], r["method"], r["ratio"], r["protocol"])]
        with (run / "predictions.csv").open("w", newline="", encoding="utf-8") as fh:
            w = csv.writer(fh)
            w.writerow(("task", "index", "protocol", "predicted_answer", "references", "score"))
            for s in mine:
                w.writerow((s["task"], s["index"], s["protocol"], s["answer"], "|".join(s["references"]), s["score"]))
        runs.append(run)
    return runs
