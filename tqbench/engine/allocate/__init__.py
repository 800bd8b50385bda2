"""Auto-policy: the least-KL per-layer policy under a byte budget, measured, solved exactly, verified, saved.

``sensitivity.py`` (one-layer chunk KL per layer, role and codec), ``solver.py`` (exact-bytes
multiple-choice knapsack), ``verify.py`` (teacher-forced frontier points on held-out text) (the saved policy,
``policy/artifact.py``, is re-exported) and ``job.py`` (``allocate_policy``: the three steps
as one cancellable, resumable job).
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
from tqbench.engine.policy.artifact import (  # the artifact lives with the policy; re-exported here
    PolicyArtifact,
    artifact_warning_for,
    is_policy_artifact,
    load_policy_artifact,
    save_policy_artifact,
)

__all__ = [
    "DEFAULT_CODECS",
    "GRANULARITIES",
    "Allocation",
    "AllocationReport",
    "FrontierPoint",
    "PolicyArtifact",
    "SensitivityTable",
    "allocate_policy",
    "artifact_warning_for",
    "calibration_ids",
    "frontier",
    "is_policy_artifact",
    "load_policy_artifact",
    "measure_sensitivity",
    "policy_from_choices",
    "rank_correlation",
    "save_policy_artifact",
    "solve_allocation",
]
