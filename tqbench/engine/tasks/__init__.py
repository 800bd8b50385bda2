"""tasks: a long-context task suite in the style of RULER (Hsieh et al. 2024), generated offline and seeded.

Torch-free to import (``suite`` loads on first use), so front ends check input before a model loads.

- ``spec``: the tasks (``TASKS``: niah_single, niah_multikey, niah_multivalue, variable_tracking, common_words,
  qa), RULER's string-match metrics, ``check_tasks`` (the input rules; torch-free)
- ``generate``: the samples, each one chat-template prompt filled to the target context
- ``suite``: ``run_tasks`` (baseline vs candidate, the baseline's answers cached), ``TasksResult``; its two halves
  ``prepare_suite`` (samples + the baseline's answers: ``SuiteBaseline``) and ``score_candidate`` (one candidate
  on a prepared suite), which a sweep uses to answer the baseline once for all its cells
- ``peer``: another library's methods (kvpress, in its own venv, as a subprocess) on the same samples, their rows
  beside the candidate's (``tasks --peer kvpress``)
"""

from tqbench.engine.tasks.spec import (
    CONTEXTS,
    DEFAULT_SAMPLES,
    PROTOCOLS,
    SUITE,
    SUITE_VERSION,
    TASKS,
    TaskSpec,
    check_protocols,
    check_tasks,
    interval95,
    string_match_all,
    string_match_part,
)

_SUITE = ("SuiteBaseline", "TasksResult", "baseline_cache_dir", "build_samples", "prepare_suite", "run_tasks",
          "score_candidate")  # torch: loaded on first use


def __getattr__(name: str):
    if name in _SUITE:
        from tqbench.engine.tasks import suite

        return getattr(suite, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "CONTEXTS",
    "DEFAULT_SAMPLES",
    "PROTOCOLS",
    "SUITE",
    "SUITE_VERSION",
    "TASKS",
    "SuiteBaseline",
    "TaskSpec",
    "TasksResult",
    "baseline_cache_dir",
    "build_samples",
    "check_protocols",
    "check_tasks",
    "interval95",
    "prepare_suite",
    "run_tasks",
    "score_candidate",
    "string_match_all",
    "string_match_part",
]
