"""Auto-policy: the least-KL per-layer policy under a byte budget, measured, solved exactly, verified, saved.

``texts.py`` (the calibration mix and the unseen verification texts), ``chunk.py`` (the chunk KL measure, with
layer skipping), ``sensitivity.py`` (one-unit chunk KL per layer or KV head, role and codec), ``solver.py``
(exact-bytes multiple-choice knapsack), ``speed.py`` (the decode-cost model and the minimum-speed constraint),
``exchange.py`` (protection options and exchange steps scored by the joint
measured KL), ``keeps.py`` and ``joint.py`` (the tokens axis: keep cells measured as the cache evicts, and the
solve over keep fractions and codecs within exact bytes; ``demote.py``: the demote tier, a layer's evicted rows
dropped or kept at a cheaper codec, measured as the cache attends them), ``verify.py`` (teacher-forced frontier points on held-out text) and ``job.py`` (``allocate_policy``:
the steps as one cancellable, resumable job). The saved policy it writes lives with
the policy: ``tqbench.engine.policy`` (``save_policy_artifact``, ``load_policy_artifact``). ``budget.py`` holds the
bounds of a budget (``check_budget``), which front ends check before a model loads: names load lazily, so that
check does not import transformers.
"""

from __future__ import annotations

from tqbench.engine.lazy import lazy_names

_JOB = "tqbench.engine.allocate.job"
_SOLVER = "tqbench.engine.allocate.solver"
_EXCHANGE = "tqbench.engine.allocate.exchange"
_SENSITIVITY = "tqbench.engine.allocate.sensitivity"
_SPEED = "tqbench.engine.allocate.speed"

#: public name -> its module
_LAZY: dict[str, str] = {
    "AllocateSpec": "tqbench.engine.allocate.spec",
    "DEFAULT_CODECS": "tqbench.engine.allocate.spec",
    "GRANULARITIES": "tqbench.engine.allocate.spec",
    "Allocation": _SOLVER,
    "DecodeCosts": _SPEED,
    "SpeedReport": _SPEED,
    "AllocationReport": _JOB,
    "ExchangeStep": _EXCHANGE,
    "JointMeasure": _EXCHANGE,
    "FrontierPoint": "tqbench.engine.allocate.verify",
    "SensitivityTable": _SENSITIVITY,
    "allocate_policy": _JOB,
    "calibration_ids": _JOB,
    "check_budget": "tqbench.engine.allocate.budget",
    "frontier": "tqbench.engine.allocate.verify",
    "frontier_texts": "tqbench.engine.allocate.verify",
    "improve": _EXCHANGE,
    "measure_sensitivity": _SENSITIVITY,
    "policy_from_choices": _SOLVER,
    "rank_correlation": _SENSITIVITY,
    "solve_allocation": _SOLVER,
    "solve_joint": "tqbench.engine.allocate.joint",
}

__all__ = list(_LAZY)

__getattr__, __dir__ = lazy_names(__name__, _LAZY)
