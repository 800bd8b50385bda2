"""Run the suite: the baseline's and a candidate's greedy answers on every sample, scored against the reference
answers (RULER's metrics, ``spec``) and the candidate against the baseline's own answer (agreement).

The baseline's answers are cached per (model fingerprint, dtype, device, baseline policy, cache mode, prompt ids,
new tokens) in ``<tqbench cache>/tasks/`` (``models.resolve.cache_dir``): a second candidate on the same suite does
not run the baseline again. ``run_tasks`` is ``prepare_suite`` (the samples and the baseline's answers) then
``score_candidate`` (one candidate); a sweep prepares once per text and scores every cell on it. The result carries rows of (dataset, model, method, compression_ratio, score) per
task and overall, as kvpress's leaderboard does; compression_ratio is kvpress's: the fraction of fp16 KV bytes
the method does not store (0 = none, 0.75 = a quarter kept), from the cache report of each run.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from tqbench.engine.events import CancelFlag, GenerationFinished, OnEvent, Progress, emit, raise_if_cancelled
from tqbench.engine.tasks.generate import Sample, make_sample, question_start
from tqbench.engine.tasks.spec import (
    DEFAULT_SAMPLES,
    SUITE,
    SUITE_VERSION,
    TASKS,
    TaskSpec,
    check_protocols,
    check_tasks,
    interval95,
)


@dataclass
class Answer:
    text: str
    score: float  # 0..1 against the references
    stored_bytes: int
    fp16_bytes: int
    context_pass_seconds: float = 0.0  # a context-pass score's scoring pass (score=kvzip)

    @property
    def compression_ratio(self) -> float:
        return 1 - self.stored_bytes / self.fp16_bytes if self.fp16_bytes else 0.0


@dataclass
class TasksResult:
    model: str
    context: int
    seed: int
    baseline: str
    candidate: str
    cache_mode: str
    samples_per_task: int
    tasks: list[str]
    samples: list[dict] = field(default_factory=list)
    baseline_cached: int = 0  # samples whose baseline answer came from the cache
    #: the candidate's protocols (``spec.PROTOCOLS``), each a row per task; the baseline answers aware (it keeps
    #: every row: the protocol changes nothing but where its prefill is cut)
    protocols: tuple[str, ...] = ("aware",)
    #: a peer's run on the same samples (``tasks --peer kvpress``): ``{"name", "presses", "ratios", "versions"}``
    #: and its answers as sample rows (``engine.tasks.peer.score_peer``); the candidate's nominal ratio (``1 - keep``)
    peer: dict | None = None
    peer_samples: list[dict] = field(default_factory=list)
    candidate_ratio: float | None = None

    @property
    def dataset(self) -> str:
        return f"{SUITE}-{self.context}"

    def _of(self, task: str | None, protocol: str | None = None) -> list[dict]:
        protocol = protocol or self.protocols[0]
        return [s for s in self.samples if (task is None or s["task"] == task)
                and s.get("protocol", "aware") == protocol]

    def task_row(self, task: str | None, protocol: str | None = None) -> dict:
        """Scores of one task (None: overall, the mean of the task scores) in points under ``protocol`` (default:
        the first run), each with its 95% interval (``spec.interval95``; overall: over every sample)."""
        protocol = protocol or self.protocols[0]
        ss = self._of(task, protocol)
        ci = {"baseline_ci": list(interval95([s["baseline_score"] for s in ss])),
              "candidate_ci": list(interval95([s["candidate_score"] for s in ss]))}
        if task is None:
            rows = [self.task_row(t, protocol) for t in self.tasks]
            mean = (lambda k: sum(r[k] for r in rows) / len(rows)) if rows else (lambda k: 0.0)
            return {"task": "overall", "protocol": protocol, "samples": sum(r["samples"] for r in rows),
                    "chance": mean("chance"), "baseline_score": mean("baseline_score"),
                    "candidate_score": mean("candidate_score"), "agreement": mean("agreement"),
                    "delta": mean("candidate_score") - mean("baseline_score"), **ci}
        n = len(ss) or 1
        base = 100 * sum(s["baseline_score"] for s in ss) / n
        cand = 100 * sum(s["candidate_score"] for s in ss) / n
        return {"task": task, "protocol": protocol, "samples": len(ss), "chance": TASKS[task].chance,
                "baseline_score": base, "candidate_score": cand,
                "agreement": 100 * sum(s["agree"] for s in ss) / n, "delta": cand - base, **ci}

    def leaderboard(self) -> list[dict]:
        """(dataset, model, method, compression_ratio, score) rows: baseline and candidate, per protocol, task and
        overall (each names its protocol and the score's 95% interval)."""
        rows = []
        for protocol in self.protocols:
            for task in [*self.tasks, None]:
                r = self.task_row(task, protocol)
                ss = self._of(task, protocol)
                for method, side in ((self.baseline, "baseline"), (self.candidate, "candidate")):
                    cr = sum(s[f"{side}_compression_ratio"] for s in ss) / (len(ss) or 1)
                    rows.append({"dataset": self.dataset, "task": r["task"], "protocol": protocol, "model": self.model,
                                 "method": method, "compression_ratio": round(cr, 6),
                                 "score": round(r[f"{side}_score"], 4), "ci95": list(r[f"{side}_ci"]),
                                 "samples": r["samples"]})
        if self.peer_samples:  # the peer's presses, each a method at its ratio (kvpress's compression_ratio)
            rows += [{"dataset": self.dataset, "task": "overall", "protocol": r["protocol"], "model": self.model,
                      "method": r["method"], "compression_ratio": r["ratio"], "score": round(r["score"], 4),
                      "ci95": r["ci95"], "samples": r["samples"]}
                     for r in self.side_by_side()["rows"] if r["library"] != "tqbench"]
        return rows

    def side_by_side(self) -> dict:
        """The candidate (at its nominal ratio), the baseline and the peer's presses as rows of one table
        (``engine.tasks.peer.side_by_side``)."""
        from tqbench.engine.tasks.peer.rows import side_by_side, tqbench_samples

        mine = tqbench_samples({"samples": self.samples, "candidate": self.candidate, "baseline": self.baseline},
                               self.candidate_ratio)
        return side_by_side(mine + self.peer_samples, self.tasks, dataset=self.dataset, model=self.model) | {
            "peer_versions": (self.peer or {}).get("versions", {}), "context": self.context}

    @classmethod
    def from_dict(cls, d: dict) -> TasksResult:
        """The result ``to_dict`` wrote (a saved session's): its samples hold every score, so the rows are the same."""
        protocols = tuple(d.get("protocols") or ("aware",))
        tasks = list(dict.fromkeys(t["task"] for t in d["tasks"]))
        sbs = d.get("side_by_side") or {}
        ratio = next((r["ratio"] for r in sbs.get("rows", ()) if r["method"] == d["candidate"]), None)
        return cls(d["model"], int(d["context"]), int(d["seed"]), d["baseline"], d["candidate"], d["cache_mode"],
                   int(d["samples_per_task"]), tasks, list(d["samples"]), int(d.get("baseline_cached", 0)),
                   protocols, d.get("peer"), list(d.get("peer_samples", ())), ratio)

    def to_dict(self) -> dict:
        return {
            "suite": SUITE, "suite_version": SUITE_VERSION, "dataset": self.dataset, "model": self.model,
            "context": self.context, "seed": self.seed, "baseline": self.baseline, "candidate": self.candidate,
            "cache_mode": self.cache_mode, "samples_per_task": self.samples_per_task,
            "baseline_cached": self.baseline_cached,
            "protocols": list(self.protocols),
            "tasks": [self.task_row(t, p) for p in self.protocols for t in self.tasks],
            "overall": self.task_row(None),
            "overall_by_protocol": {p: self.task_row(None, p) for p in self.protocols},
            "leaderboard": self.leaderboard(), "samples": self.samples,
            **({"peer": self.peer, "peer_samples": self.peer_samples,
                "side_by_side": {k: v for k, v in self.side_by_side().items() if k != "samples"}}
               if self.peer is not None else {}),
        }


# ---- the baseline's cache ------------------------------------------------------------------------------------
def baseline_cache_dir() -> Path:
    from tqbench.engine.models.resolve import cache_dir

    return cache_dir() / "tasks"


def _sample_key(engine, baseline: str, cache_mode: str, sample: Sample, max_new_tokens: int) -> str:
    lm = engine.loaded
    h = hashlib.sha256(json.dumps([SUITE_VERSION, lm.fingerprint, str(lm.dtype), str(lm.device), baseline,
                                   cache_mode, max_new_tokens]).encode())
    h.update(sample.ids.numpy().astype("int64").tobytes())
    return h.hexdigest()


class BaselineCache:
    """Baseline answers on disk, one JSON file per model fingerprint (``folder`` None: no cache)."""

    def __init__(self, folder: Path | None, fingerprint: str) -> None:
        self.path = folder / f"{fingerprint[:32]}.json" if folder is not None else None
        self.data: dict = {}
        if self.path is not None and self.path.is_file():
            try:
                self.data = json.loads(self.path.read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError):
                self.data = {}  # a damaged cache is rebuilt, never trusted

    def get(self, key: str) -> dict | None:
        return self.data.get(key)

    def put(self, key: str, value: dict) -> None:
        if self.path is None:
            return
        from tqbench.engine.atomic import atomic_write

        self.data[key] = value
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(self.path, json.dumps(self.data).encode("utf-8"))


# ---- running ------------------------------------------------------------------------------------------------
def build_samples(engine, tasks: list[TaskSpec], context: int, samples: int, seed: int) -> list[Sample]:
    return [make_sample(engine, t, context, i, samples, seed) for t in tasks for i in range(samples)]


def _answer(engine, sample: Sample, task: TaskSpec, pol, cache_mode: str, cancel: CancelFlag | None,
            protocol: str = "aware") -> Answer:
    """``pol``'s answer to ``sample``: ``aware``, the whole prompt prefilled (and compressed) at once; ``agnostic``,
    the context compressed first (``Engine.compress``), then the question appended to it (``question_start``)."""
    res = None
    if protocol == "agnostic":
        cut = question_start(engine, sample)
        ctx = engine.compress(sample.ids[:, :cut], pol, cache_mode)
        events = ctx.stream(sample.ids[:, cut:], max_new_tokens=task.max_new_tokens, cancel=cancel)
    else:
        ctx = None
        events = engine.stream(sample.ids, pol, cache_mode, max_new_tokens=task.max_new_tokens, cancel=cancel)
    for ev in events:
        if isinstance(ev, GenerationFinished):
            res = ev.result
    raise_if_cancelled(cancel, "tasks")  # a cut-off answer is not scored
    rep = res.cache_report
    stored = int(rep.compressed_storage_bytes) if rep is not None else 0
    dense = int(rep.dense_fp16_bytes) if rep is not None else 0
    pass_s = ctx.context_pass_seconds if ctx is not None else res.context_pass_seconds
    return Answer(res.text, task.score(res.text, sample.references), stored, dense, pass_s)


@dataclass
class SuiteBaseline:
    """The suite's samples at one context and the baseline's answer to each (``prepare_suite``): what every
    candidate on this suite is scored beside. A sweep keeps one per text and scores each cell against it."""

    context: int
    seed: int
    baseline: str  # the baseline policy's label
    cache_mode: str
    samples_per_task: int
    tasks: list[str]
    samples: list[Sample]
    answers: list[Answer]
    cached: int  # answers that came from the on-disk cache


def prepare_suite(
    engine,
    context: int,
    *,
    tasks: list[str] | None = None,
    samples: int = DEFAULT_SAMPLES,
    baseline="fp16",
    cache_mode: str = "compressed",
    seed: int = 0,
    cache: bool = True,
    cache_folder: Path | None = None,
    on_event: OnEvent | None = None,
    cancel: CancelFlag | None = None,
    total: int | None = None,
) -> SuiteBaseline:
    """Build the samples and answer each with ``baseline`` (from the on-disk cache where it holds the answer,
    unless ``cache`` is False). ``total``: the progress total to report against (default: these answers)."""
    specs = check_tasks(tasks, context, samples, engine.max_context, engine.name)
    base_pol = engine.check_policy(baseline)
    store = BaselineCache((cache_folder or baseline_cache_dir()) if cache else None, engine.loaded.fingerprint)
    emit(on_event, Progress("tasks", 0, None, f"building {len(specs) * samples} samples at {context} tokens"))
    built = build_samples(engine, specs, context, samples, seed)
    total = len(built) if total is None else total
    answers, cached = [], 0
    for done, s in enumerate(built):
        task = TASKS[s.task]
        key = _sample_key(engine, base_pol.label, cache_mode, s, task.max_new_tokens)
        hit = store.get(key)
        if hit is not None:
            answers.append(Answer(hit["text"], task.score(hit["text"], s.references), hit["stored_bytes"],
                                  hit["fp16_bytes"]))
            cached += 1
            continue
        raise_if_cancelled(cancel, "tasks")
        emit(on_event, Progress("tasks", done, total, f"{base_pol.label}: {s.task} #{s.index}"))
        base = _answer(engine, s, task, base_pol, cache_mode, cancel)
        store.put(key, {"text": base.text, "stored_bytes": base.stored_bytes, "fp16_bytes": base.fp16_bytes})
        answers.append(base)
    return SuiteBaseline(context, seed, base_pol.label, cache_mode, samples, [t.name for t in specs], built,
                         answers, cached)


def score_candidate(engine, suite: SuiteBaseline, candidate, *, on_event: OnEvent | None = None,
                    cancel: CancelFlag | None = None, done: int = 0, total: int | None = None,
                    protocols=("aware",)) -> TasksResult:
    """``candidate``'s answers on ``suite``'s samples under each of ``protocols`` (``spec.PROTOCOLS``), scored
    beside the baseline's. ``done``/``total``: where the progress count starts and what it counts to (default:
    these answers)."""
    protocols = check_protocols(protocols)
    cand_pol = engine.check_policy(candidate)
    label = cand_pol.label
    total = done + len(protocols) * len(suite.samples) if total is None else total
    result = TasksResult(engine.name, suite.context, suite.seed, suite.baseline, label, suite.cache_mode,
                         suite.samples_per_task, list(suite.tasks), baseline_cached=suite.cached, protocols=protocols)
    for protocol, s, base in ((p, s, b) for p in protocols for s, b in zip(suite.samples, suite.answers)):
        task = TASKS[s.task]
        raise_if_cancelled(cancel, "tasks")
        emit(on_event, Progress("tasks", done, total, f"{label} ({protocol}): {s.task} #{s.index}"))
        cand = _answer(engine, s, task, cand_pol, suite.cache_mode, cancel, protocol)
        done += 1
        result.samples.append({
            "task": s.task, "index": s.index, "protocol": protocol, "prompt_tokens": s.prompt_tokens,
            "context_tokens": question_start(engine, s) if protocol == "agnostic" else s.prompt_tokens,
            "candidate_context_pass_seconds": round(cand.context_pass_seconds, 4),
            "references": list(s.references),
            "baseline_answer": base.text, "candidate_answer": cand.text, "baseline_score": base.score,
            "candidate_score": cand.score, "agree": cand.text.strip() == base.text.strip(),
            "baseline_compression_ratio": base.compression_ratio,
            "candidate_compression_ratio": cand.compression_ratio})
    emit(on_event, Progress("tasks", done, total, "done"))
    return result


def run_tasks(
    engine,
    candidate,
    context: int,
    *,
    tasks: list[str] | None = None,
    samples: int = DEFAULT_SAMPLES,
    baseline="fp16",
    cache_mode: str = "compressed",
    seed: int = 0,
    cache: bool = True,
    cache_folder: Path | None = None,
    on_event: OnEvent | None = None,
    cancel: CancelFlag | None = None,
    protocols=("aware",),
) -> TasksResult:
    """The suite at ``context`` tokens: baseline (cached unless ``cache`` is False) and ``candidate`` on every sample
    under each of ``protocols`` (``prepare_suite``, then ``score_candidate``). Raises ``Cancelled`` when
    ``cancel()`` turns true."""
    protocols = check_protocols(protocols)
    engine.check_policy(candidate)  # a bad candidate is refused before the baseline runs
    n = len(check_tasks(tasks, context, samples, engine.max_context, engine.name)) * samples
    total = (1 + len(protocols)) * n
    suite = prepare_suite(engine, context, tasks=tasks, samples=samples, baseline=baseline, cache_mode=cache_mode,
                          seed=seed, cache=cache, cache_folder=cache_folder, on_event=on_event, cancel=cancel,
                          total=total)
    return score_candidate(engine, suite, candidate, on_event=on_event, cancel=cancel, done=n, total=total,
                           protocols=protocols)
