"""Auto-policy: the least-KL per-layer policy under a byte budget, measured, solved exactly, verified, saved.

``texts.py`` (the calibration mix and the unseen verification texts), ``chunk.py`` (the chunk KL measure, with
layer skipping), ``sensitivity.py`` (one-unit chunk KL per layer or KV head, role and codec), ``solver.py``
(exact-bytes multiple-choice knapsack), ``exchange.py`` (protection options and exchange steps scored by the joint
measured KL), ``verify.py`` (teacher-forced frontier points on held-out text) and ``job.py`` (``allocate_policy``:
the steps as one cancellable, resumable job). The saved policy it writes lives with
the policy: ``tqbench.engine.policy`` (``save_policy_artifact``, ``load_policy_artifact``).
"""

from tqbench.engine.allocate.exchange import ExchangeStep, JointMeasure, improve
from tqbench.engine.allocate.job import (
    DEFAULT_CODECS,
    GRANULARITIES,
    AllocationReport,
    allocate_policy,
    calibration_ids,
)
from tqbench.engine.allocate.sensitivity import SensitivityTable, measure_sensitivity, rank_correlation
from tqbench.engine.allocate.solver import Allocation, policy_from_choices, solve_allocation
from tqbench.engine.allocate.verify import FrontierPoint, frontier, frontier_texts

__all__ = [
    "DEFAULT_CODECS",
    "GRANULARITIES",
    "Allocation",
    "AllocationReport",
    "ExchangeStep",
    "JointMeasure",
    "FrontierPoint",
    "SensitivityTable",
    "allocate_policy",
    "calibration_ids",
    "frontier",
    "frontier_texts",
    "improve",
    "measure_sensitivity",
    "policy_from_choices",
    "rank_correlation",
    "solve_allocation",
]
