"""validate: does a candidate policy change what the model says? Import everything from here.

- ``validation``: ``validate``, ``self_test`` (baseline vs candidate through ``Engine.lockstep``)
- ``report``: ``ValidationReport``, ``build_report``; ``recommendation``: ``recommend`` (a ``Recommendation``:
  status, hint, next policy, the ``Savings`` and ``Evidence`` it was decided on); ``evidence``: the sample rule
- ``steps``: ``StepRecord`` and its one builder ``step_record``, step/logit comparisons, policy summary
- ``quality``: teacher-forced quality (``teacher_forced_quality``, ``teacher_forced``, ``baseline_logprobs``)
- ``compare``: ``compare_policies`` over several policies and prompts; ``niah``: needle in a haystack

Every long job here takes ``on_event=`` and ``cancel=`` and raises ``Cancelled`` (see ``tqbench.engine.generate``).
"""

from tqbench.engine.events import Cancelled
from tqbench.engine.validate.compare import (
    CompareResult,
    CompareRow,
    compare_policies,
    default_policies,
    recommend_policy,
)
from tqbench.engine.validate.evidence import Evidence, evidence
from tqbench.engine.validate.niah import (
    NiahResult,
    build_haystack,
    make_passphrase,
    needle_in_haystack,
    score_answer,
)
from tqbench.engine.validate.quality import (
    TeacherForcedReport,
    TeacherForcedResult,
    baseline_logprobs,
    check_teacher_forced_args,
    corpus_ids,
    teacher_forced,
    teacher_forced_quality,
)
from tqbench.engine.validate.recommendation import STATUS, Recommendation, recommend
from tqbench.engine.validate.report import ValidationReport, build_report
from tqbench.engine.validate.steps import (
    LogitComparison,
    PolicySummary,
    SidePair,
    StepComparison,
    StepRecord,
    check_generation_args,
    logit_comparison,
    policy_summary,
    step_comparison,
    step_record,
)
from tqbench.engine.validate.validation import self_test, validate

__all__ = [
    "STATUS",
    "Cancelled",
    "CompareResult",
    "CompareRow",
    "Evidence",
    "NiahResult",
    "Recommendation",
    "LogitComparison",
    "PolicySummary",
    "SidePair",
    "StepComparison",
    "StepRecord",
    "TeacherForcedReport",
    "TeacherForcedResult",
    "ValidationReport",
    "baseline_logprobs",
    "build_haystack",
    "build_report",
    "check_generation_args",
    "check_teacher_forced_args",
    "compare_policies",
    "corpus_ids",
    "default_policies",
    "evidence",
    "logit_comparison",
    "make_passphrase",
    "needle_in_haystack",
    "policy_summary",
    "recommend",
    "recommend_policy",
    "score_answer",
    "self_test",
    "step_comparison",
    "step_record",
    "teacher_forced",
    "teacher_forced_quality",
    "validate",
]
