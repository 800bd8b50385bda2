"""Run one sweep cell on a loaded engine: the existing engine functions, nothing re-implemented.

- ``validate`` / ``speed`` (prompt texts): the baseline and the candidate generate greedily and are compared
  exactly as ``compare-policies`` compares a cell (``validate.compare``): verdict, token match, same-context
  KL, top-1, and the decode tokens/s of both runs in this process (``policy_summary``).
- ``teacher_forced`` (prompt and corpus texts): ``validate.quality.teacher_forced`` against the dense
  baseline's log-probabilities: KL, top-1 agreement, both perplexities, report bytes.
- ``niah``: ``validate.niah``'s haystack, answer and score, for the candidate and the baseline.
- ``tasks``: the long-context task suite (``engine.tasks``): ``prepare_suite`` once per text (the samples and the
  baseline's answers, from the suite's on-disk cache where it holds them), ``score_candidate`` per cell; the result
  is the suite's own (per task and overall, and its (dataset, model, method, compression_ratio, score) rows).
- ``bytes``: the cache report's packed bytes where a run measured them, plus ``estimate_kv`` (exact bytes
  from the model's geometry, all metadata included) at each ``[bytes] tokens`` length.

A ``CellRunner`` keeps each text's baseline (greedy run, teacher-forced log-probs, NIAH answer, the suite's
answers) for the cells after it, and nothing per cell, so a shard computes each baseline once. Every step checks ``cancel``.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import numpy as np

from tqbench.engine.cache.estimate import estimate_kv
from tqbench.engine.events import CancelFlag, raise_if_cancelled
from tqbench.engine.sweep.cells import Cell
from tqbench.engine.sweep.spec import SweepSpec
from tqbench.engine.validate.compare import _cell as compare_cell
from tqbench.engine.validate.compare import _collect as collect_run
from tqbench.engine.validate.compare import _steps as pair_steps
from tqbench.engine.validate.evidence import evidence
from tqbench.engine.validate.niah import _answer as niah_answer
from tqbench.engine.validate.niah import _prompts as niah_prompts
from tqbench.engine.validate.niah import score_answer
from tqbench.engine.validate.quality import _tokens as tf_tokens
from tqbench.engine.validate.quality import baseline_logprobs, teacher_forced
from tqbench.engine.validate.recommendation import recommend
from tqbench.engine.validate.report import candidate_savings


@dataclass
class CellOutput:
    results: dict  # measurement name -> JSON-safe dict
    arrays: dict[str, np.ndarray] = field(default_factory=dict)  # per-step curves, saved as safetensors
    recommendation: dict | None = None  # validate.recommendation.recommend for the cell's verdict


class CellRunner:
    """Runs cells of one model; ``engine`` is loaded once for all of them."""

    def __init__(self, engine, spec: SweepSpec, cancel: CancelFlag | None = None) -> None:
        self.engine = engine
        self.spec = spec
        self.cancel = cancel
        self._greedy: dict[str, tuple] = {}
        self._tf: dict[str, tuple] = {}
        self._niah: dict[str, tuple] = {}
        self._tasks: dict[str, object] = {}  # text name -> engine.tasks.SuiteBaseline

    # ---- baselines, once per text -------------------------------------------------------------------
    def _kw(self) -> dict:
        return dict(max_new_tokens=self.spec.validate.max_new_tokens, collect_logits=True, cancel=self.cancel)

    def greedy_baseline(self, cell: Cell):
        t = cell.text
        if t.name not in self._greedy:
            ids = self.engine.encode_prompt(t.prompt, self.spec.chat, self.spec.validate.max_new_tokens)
            base = collect_run(self.engine.stream(ids, self.spec.baseline.policy, self.spec.cache_mode,
                                                  run="baseline", **self._kw()), self.cancel)
            self._greedy[t.name] = (ids, base)
        return self._greedy[t.name]

    def tf_baseline(self, cell: Cell):
        t, s = cell.text, self.spec.teacher_forced
        if t.name not in self._tf:
            ids, prefill, source = tf_tokens(self.engine, t.prompt, t.corpus, s.context_tokens, s.eval_tokens,
                                             self.spec.chat, s.max_new_tokens, self.cancel)
            base = baseline_logprobs(self.engine, ids, prefill, cancel=self.cancel)
            self._tf[t.name] = (ids, prefill, source, base)
        return self._tf[t.name]

    def niah_baseline(self, cell: Cell):
        t, s = cell.text, self.spec.niah
        if t.name not in self._niah:
            prompts = niah_prompts(self.engine, [t.niah_length], [t.niah_depth], self.spec.chat, s.max_new_tokens,
                                   None, s.seed)
            ids, phrase = prompts[(t.niah_length, t.niah_depth)]
            answer = niah_answer(self.engine, ids, self.spec.baseline.policy, self.spec.cache_mode,
                                 s.max_new_tokens, self.cancel)
            self._niah[t.name] = (ids, phrase, answer)
        return self._niah[t.name]

    def tasks_baseline(self, cell: Cell):
        from tqbench.engine.tasks import prepare_suite

        t = cell.text
        if t.name not in self._tasks:
            self._tasks[t.name] = prepare_suite(
                self.engine, t.tasks_context, tasks=list(t.tasks_names) if t.tasks_names else None,
                samples=t.tasks_samples, baseline=self.spec.baseline.policy, cache_mode=self.spec.cache_mode,
                seed=self.spec.tasks.seed, cache=self.spec.tasks.cache, cancel=self.cancel)
        return self._tasks[t.name]

    # ---- one cell ---------------------------------------------------------------------------------
    def run(self, cell: Cell) -> CellOutput:
        raise_if_cancelled(self.cancel, "sweep")
        out = CellOutput({})
        pol = cell.policy.policy
        measured_tokens = None
        report_bytes = None
        if "validate" in cell.measure or "speed" in cell.measure:
            ids, base = self.greedy_baseline(cell)
            cand = collect_run(self.engine.stream(ids, pol, self.spec.cache_mode, run="candidate", **self._kw()),
                               self.cancel)
            c = compare_cell(pol, 0, base, cand, self.spec.validate.quality_threshold)
            summ = c["policy_summary"]
            if "validate" in cell.measure:
                logits = c["logit_comparison"] or {}
                out.results["validate"] = {
                    "verdict": c["verdict"], **c["comparison"], "top1_match_ratio":
                    c["step_comparison"]["top1_match_ratio"], "kl_mean": logits.get("kl_mean"),
                    "kl_max": logits.get("kl_max"), "steps_compared": logits.get("steps_compared"),
                    "max_new_tokens": self.spec.validate.max_new_tokens,
                    "baseline_text": base.result.text, "candidate_text": cand.result.text,
                }
                steps = pair_steps(base, cand)
                out.arrays["validate.step_kl"] = np.array(
                    [math.nan if s.kl is None else s.kl for s in steps], dtype=np.float64)
                out.arrays["validate.same_token"] = np.array([s.same_token for s in steps], dtype=np.uint8)
                geometry = self.engine.geometry
                out.recommendation = recommend(
                    c["verdict"], pol, geometry, storage_only=self.spec.cache_mode == "dense-shadow",
                    savings=candidate_savings(self.engine, pol, self.spec.baseline.policy, cand.result, geometry),
                    evidence=evidence([max(len(base.result.token_ids), len(cand.result.token_ids))])).to_dict()
            if "speed" in cell.measure:
                out.results["speed"] = {k: summ[k] for k in ("baseline_decode_tokens_per_second",
                                                             "candidate_decode_tokens_per_second",
                                                             "throughput_ratio")}
                out.results["speed"]["threads"] = _threads()
                out.results["speed"]["loadavg"] = list(os.getloadavg())  # a shared machine slows any run
                out.arrays["speed.baseline_step_seconds"] = np.array(base.result.step_seconds, dtype=np.float64)
                out.arrays["speed.candidate_step_seconds"] = np.array(cand.result.step_seconds, dtype=np.float64)
            rep = cand.result.cache_report
            measured_tokens = rep.tokens if rep is not None else None
            report_bytes = {"source": "validate candidate run", "tokens": measured_tokens,
                            "compressed_storage_bytes": summ["compressed_storage_bytes"],
                            "dense_fp16_bytes": summ["dense_fp16_bytes"],
                            "bits_per_element": summ["bits_per_element"], "memory_saved_pct": summ["memory_saved_pct"]}
        if "teacher_forced" in cell.measure:
            ids, prefill, source, base_lp = self.tf_baseline(cell)
            r = teacher_forced(self.engine, ids, prefill, pol, self.spec.cache_mode, baseline=base_lp,
                               cancel=self.cancel)
            out.results["teacher_forced"] = {**r.to_dict(), "kv_policy": cell.policy.label, "source": source}
            if report_bytes is None:
                report_bytes = {"source": "teacher-forced candidate run", "tokens": int(ids.shape[1]) - 1,
                                "compressed_storage_bytes": r.compressed_storage_bytes,
                                "dense_fp16_bytes": r.dense_fp16_bytes, "bits_per_element": r.bits_per_element,
                                "memory_saved_pct": r.memory_saved_pct}
        if "niah" in cell.measure:
            ids, phrase, base_answer = self.niah_baseline(cell)
            s = self.spec.niah
            answer = niah_answer(self.engine, ids, pol, self.spec.cache_mode, s.max_new_tokens, self.cancel)
            recalled, score = score_answer(answer, phrase)
            b_recalled, b_score = score_answer(base_answer, phrase)
            out.results["niah"] = {"length": cell.text.niah_length, "depth": cell.text.niah_depth,
                                   "prompt_tokens": int(ids.shape[1]), "passphrase": phrase, "answer": answer,
                                   "recalled": recalled, "score": score, "baseline_answer": base_answer,
                                   "baseline_recalled": b_recalled, "baseline_score": b_score}
            measured_tokens = measured_tokens or int(ids.shape[1])
        if "tasks" in cell.measure:
            from tqbench.engine.tasks import score_candidate

            res = score_candidate(self.engine, self.tasks_baseline(cell), pol, cancel=self.cancel)
            out.results["tasks"] = res.to_dict()
        if "bytes" in cell.measure:
            geo = self.engine.geometry
            est = [estimate_kv(pol, geo, n).to_dict() for n in self.spec.bytes_tokens]
            for e in est:
                e.pop("layer_bytes", None)
            out.results["bytes"] = {"measured": report_bytes, "estimates": est}
        raise_if_cancelled(self.cancel, "sweep")
        return out


def _threads() -> int:
    import torch

    return torch.get_num_threads()
