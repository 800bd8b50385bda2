"""Auto-policy: the least-KL per-layer policy under a byte budget, measured, solved exactly, verified, saved.

``sensitivity.py`` (one-layer chunk KL per layer, role and codec), ``solver.py`` (exact-bytes
multiple-choice knapsack), ``verify.py`` (teacher-forced frontier points on held-out text) and ``job.py``
(``allocate_policy``: the three steps as one cancellable, resumable job). The saved policy it writes lives with
the policy: ``tqbench.engine.policy`` (``save_policy_artifact``, ``load_policy_artifact``).
"""

from tqbench.engine.allocate.job import (
    DEFAULT_CODECS,
    GRANULARITIES,
    AllocationReport,
    allocate_policy,
    calibration_ids,
)
from tqbench.engine.allocate.sensitivity import SensitivityTable, measure_sensitivity, rank_correlation
from tqbench.engine.allocate.solver import Allocation, policy_from_choices, solve_allocation
from tqbench.engine.allocate.verify import FrontierPoint, frontier

__all__ = [
    "DEFAULT_CODECS",
    "GRANULARITIES",
    "Allocation",
    "AllocationReport",
    "FrontierPoint",
    "SensitivityTable",
    "allocate_policy",
    "calibration_ids",
    "frontier",
    "measure_sensitivity",
    "policy_from_choices",
    "rank_correlation",
    "solve_allocation",
]
