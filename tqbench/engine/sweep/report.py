"""The sweep report: per model, one row per policy (its cells aggregated), ranked by bits and quality, and the
recommendation rule's answer (``validate.compare.recommend_policy``, the rule ``compare-policies`` uses).

Ranking: rows sort by bits per element (fewest first): the exact estimate at the first ``[bytes] tokens``
length when the sweep measured bytes (a deployment's context, not the short test text), else the bits the runs'
cache reports measured; a row is on the *frontier* when no other policy
of the model has fewer-or-equal bits and lower-or-equal quality loss with one strictly better. Quality loss is the
teacher-forced KL when the sweep measured it, else the greedy same-context KL. A policy with a failed cell gets
no verdict and is left out of the recommendation (named in ``failed_policies``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from tqbench.engine.metrics import VERDICTS, worst_verdict
from tqbench.engine.validate.compare import CompareResult, CompareRow, recommend_policy

#: what legitimately differs between two runs of the same cell: timings, where and with how many threads it ran
TIMING_KEYS = ("seconds", "where", "threads")


def numbers(doc: dict) -> dict:
    """A cell document without its timings (``speed`` included), the arrays' file and where it ran: two runs of
    one spec on the same machine type (in-process and on Ray) must give equal ``numbers``."""
    d = {k: v for k, v in doc.items() if k not in TIMING_KEYS and k != "arrays"}
    d["results"] = {k: v for k, v in d.get("results", {}).items() if k != "speed"}
    return d


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return round(sum(xs) / len(xs), 6) if xs else None


def _get(doc: dict, *path):
    for p in path:
        if not isinstance(doc, dict) or p not in doc or doc[p] is None:
            return None
        doc = doc[p]
    return doc


@dataclass
class SweepReport:
    name: str
    baseline: str
    cache_mode: str
    measure: list[str]
    max_new_tokens: int = 32  # the greedy runs' length (what 'open in Run' generates)
    models: list[dict] = field(default_factory=list)  # {model, rows, recommendation, failed_policies}
    cells: list[dict] = field(default_factory=list)  # every cell document of the current spec
    missing: list[str] = field(default_factory=list)  # cell ids with no result (a cancelled or partial sweep)
    leaderboard: list[dict] = field(default_factory=list)  # the task suite's rows, every cell's (``leaderboard``)

    def to_dict(self) -> dict:
        return {"name": self.name, "baseline": self.baseline, "cache_mode": self.cache_mode,
                "measure": self.measure, "max_new_tokens": self.max_new_tokens, "models": self.models, "cells": self.cells, "missing": self.missing,
                "leaderboard": self.leaderboard,
                "ranking": "rows by bits per element (estimate at the first [bytes] length, else measured); frontier = no policy with <= bits and <= quality "
                           "loss (teacher-forced KL, else greedy KL), one strictly"}

    @classmethod
    def from_dict(cls, d: dict) -> SweepReport:
        return cls(d["name"], d["baseline"], d["cache_mode"], list(d["measure"]), d.get("max_new_tokens", 32),
                   list(d["models"]), list(d["cells"]), list(d.get("missing", [])), list(d.get("leaderboard", [])))

    @property
    def failed(self) -> list[dict]:
        return [c for c in self.cells if c["status"] != "ok"]

    def as_compare_result(self) -> CompareResult:
        """Every cell as a row of a ``CompareResult`` (the workbench's Compare tab shows it as it is):
        ``policy`` is the cell's label, ``row_key`` its id, ``prompt`` its text (for 'open in Run')."""
        rows = []
        for c in self.cells:
            k = c["cell"]
            v = _get(c, "results", "validate") or {}
            tf = _get(c, "results", "teacher_forced") or {}
            by = _get(c, "results", "bytes", "measured") or {}
            rows.append(CompareRow(
                policy=f"{k['policy']} @ {k['text']['name']} [{_model_label(k['model'])}]"
                       + ("" if c["status"] == "ok" else " (failed)"),
                row_key=c["cell_id"], policy_string=k["policy_string"], sweep_policy=k["policy"],
                prompt=k["text"].get("prompt") or "",
                verdict=v.get("verdict") or ("error" if c["status"] != "ok" else None),
                memory_saved_pct=by.get("memory_saved_pct"), bits_per_element=by.get("bits_per_element"),
                token_match_ratio=v.get("token_match_ratio"), prefix_match_ratio=v.get("prefix_match_ratio"),
                top1_match_ratio=v.get("top1_match_ratio", tf.get("top1_agreement")),
                kl_mean=v.get("kl_mean", tf.get("kl_mean")),
                throughput_ratio=_get(c, "results", "speed", "throughput_ratio"),
            ))
        prompts = sorted({r.prompt for r in rows if r.prompt})
        res = CompareResult(", ".join(m["model"] for m in self.models), self.baseline, self.cache_mode,
                            self.cache_mode, prompts, self.max_new_tokens, 0.9, self.cache_mode == "dense-shadow",
                            rows=rows)
        if not self.models:
            res.recommendation = {"status": "unfinished", "recommended_policy": None,
                                  "note": "the sweep did not finish: resume it for the report"}
        elif len(self.models) == 1:
            res.recommendation = self.models[0]["recommendation"]
        else:
            res.recommendation = {
            "status": "per-model", "recommended_policy": "; ".join(
                f"{m['model']}: {m['recommendation'].get('recommended_policy')}" for m in self.models)}
        return res


def _model_label(m: dict) -> str:
    extra = [m[x] for x in ("dtype", "device") if m.get(x, "auto") != "auto"]
    return m["spec"] + (f" ({', '.join(extra)})" if extra else "")


def _row(policy: str, policy_string: str, cells: list[dict]) -> dict:
    ok = [c for c in cells if c["status"] == "ok"]
    v = [_get(c, "results", "validate") for c in ok]
    v = [x for x in v if x]
    tf = [x for x in (_get(c, "results", "teacher_forced") for c in ok) if x]
    nh = [x for x in (_get(c, "results", "niah") for c in ok) if x]
    ts = [x["overall"] for x in (_get(c, "results", "tasks") for c in ok) if x]
    tcr = [r["compression_ratio"] for x in (_get(c, "results", "tasks") for c in ok) if x
           for r in x["leaderboard"] if r["task"] == "overall" and r["method"] == x["candidate"]]
    measured = [x for x in (_get(c, "results", "bytes", "measured") for c in ok) if x]
    est = [x for x in (_get(c, "results", "bytes", "estimates") for c in ok) if x]
    row = {
        "policy": policy, "policy_string": policy_string, "cells": len(cells), "failed_cells": len(cells) - len(ok),
        "verdict": worst_verdict([x["verdict"] for x in v]) if v and len(ok) == len(cells) else None,
        "verdicts": [x["verdict"] for x in v],
        "token_match_ratio": _mean([x["token_match_ratio"] for x in v]),
        "top1_match_ratio": _mean([x["top1_match_ratio"] for x in v]),
        "kl_mean": _mean([x["kl_mean"] for x in v]),
        "tf_kl_mean": _mean([x["kl_mean"] for x in tf]),
        "tf_kl_max": max((x["kl_max"] for x in tf), default=None),
        "tf_top1_agreement": _mean([x["top1_agreement"] for x in tf]),
        "tf_ppl_ratio": _mean([x["ppl_candidate"] / x["ppl_baseline"] for x in tf if x["ppl_baseline"]]),
        "niah_recall": _mean([float(x["recalled"]) for x in nh]),
        "niah_baseline_recall": _mean([float(x["baseline_recalled"]) for x in nh]),
        "tasks_score": _mean([x["candidate_score"] for x in ts]),  # points, the mean over the policy's suites
        "tasks_baseline_score": _mean([x["baseline_score"] for x in ts]),
        "tasks_delta": _mean([x["delta"] for x in ts]),
        "tasks_compression_ratio": _mean(tcr),
        "bits_per_element": _mean([x["bits_per_element"] for x in measured]),
        "memory_saved_pct": _mean([x["memory_saved_pct"] for x in measured]),
        "throughput_ratio": _mean([_get(c, "results", "speed", "throughput_ratio") for c in ok]),
        "estimated_bytes": est[0] if est else None,  # the same for every text of a model
    }
    first = est[0][0] if est and est[0] else None
    row["est_tokens"] = first["seq_len"] if first else None
    row["est_bits_per_element"] = first["bits_per_element"] if first else None
    row["rank_bits"] = row["est_bits_per_element"] if first else row["bits_per_element"]
    return row


def _frontier(rows: list[dict]) -> None:
    def loss(r):
        return r["tf_kl_mean"] if r["tf_kl_mean"] is not None else r["kl_mean"]

    for r in rows:
        b, q = r["rank_bits"], loss(r)
        if b is None or q is None:
            r["frontier"] = None
            continue
        r["frontier"] = not any(
            o is not r and o["rank_bits"] is not None and loss(o) is not None
            and o["rank_bits"] <= b and loss(o) <= q and (o["rank_bits"] < b or loss(o) < q)
            for o in rows)


def leaderboard(cells: list[dict]) -> list[dict]:
    """The task suite's (dataset, task, model, method, compression_ratio, score, samples) rows of every cell
    (``engine.tasks.TasksResult.leaderboard``): each candidate's, and the baseline's once per (model, dataset)."""
    rows, seen = [], set()
    for c in cells:
        t = _get(c, "results", "tasks")
        if c["status"] != "ok" or not t:
            continue
        for r in t["leaderboard"]:
            key = (r["model"], r["dataset"], r["task"], r["method"])
            if r["method"] == t["baseline"] and key in seen:
                continue
            seen.add(key)
            rows.append({**r, "cell_id": c["cell_id"]} if r["method"] == t["candidate"] else r)
    return rows


def build_report(spec, cells: list, docs: dict[str, dict]) -> SweepReport:
    """``cells``: the spec's expansion; ``docs``: cell id -> stored cell document (missing ids are reported)."""
    rep = SweepReport(spec.name, spec.baseline.label, spec.cache_mode, list(spec.measure),
                      spec.validate.max_new_tokens)
    rep.cells = [docs[c.cell_id] for c in cells if c.cell_id in docs]
    rep.missing = [c.cell_id for c in cells if c.cell_id not in docs]
    rep.leaderboard = leaderboard(rep.cells)
    for model in spec.models:
        mine = [c for c in cells if c.model == model]
        rows = []
        for pol in spec.policies:
            pc = [docs[c.cell_id] for c in mine if c.policy == pol and c.cell_id in docs]
            rows.append(_row(pol.label, pol.policy_string, pc))
        _frontier(rows)
        rows.sort(key=lambda r: (r["rank_bits"] is None, r["rank_bits"] or 0.0,
                                 VERDICTS.index(r["verdict"]) if r["verdict"] in VERDICTS else len(VERDICTS)))
        for i, r in enumerate(rows):
            r["rank"] = i + 1
        failed = [r["policy"] for r in rows if r["failed_cells"]]
        usable = [r for r in rows if r["verdict"] is not None and r["memory_saved_pct"] is not None]
        if "validate" not in spec.measure:
            rec = {"status": "no-verdicts", "recommended_policy": None,
                   "note": "the rule needs verdicts: add \"validate\" to `measure` (and a prompt text)"}
        elif not usable:
            rec = {"status": "no-verdicts", "recommended_policy": None,
                   "note": "no policy has a verdict on every prompt (failed or missing cells)"}
        else:
            rec = recommend_policy([CompareRow.from_dict(r) for r in usable], spec.baseline.label,
                                   spec.cache_mode == "dense-shadow")
        rec["failed_policies"] = failed
        model_names = sorted({c.get("model_name") for c in rep.cells
                              if c["cell"]["model"] == asdict(model) and c.get("model_name")})
        rep.models.append({"model": model.label, "model_name": model_names[0] if model_names else None,
                           "rows": rows, "recommendation": rec})
    return rep
