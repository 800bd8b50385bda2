"""sweep: models x policies x texts, every cell measured with the engine's own functions. Import from here.

- ``spec``: ``load_spec`` / ``parse_spec`` (TOML -> ``SweepSpec``; ``SpecError`` names the bad key)
- ``cells``: ``expand`` (the spec's cells), ``shards``; ``measure``: ``CellRunner`` (one cell on a loaded engine)
- ``store``: ``SweepDir`` (atomic per-cell JSON + safetensors, the report); ``report``: ``SweepReport``
- ``run``: ``run_sweep`` (in-process, or on Ray with ``ray=True`` via ``ray_runner``), ``resume`` included

``run_sweep`` takes ``on_event=`` and ``cancel=`` like every long job (events: ``sweep.events`` and a
``Progress("sweep", ...)`` per finished cell) and raises ``Cancelled`` when cancelled.
"""

from tqbench.engine.sweep.cells import Cell, expand, shards
from tqbench.engine.sweep.events import SweepCellFinished, SweepCellStarted, SweepModelLoaded, SweepPlanned
from tqbench.engine.sweep.ray_runner import INSTALL_HINT, RayMissing, check_ray
from tqbench.engine.sweep.report import SweepReport, build_report, numbers
from tqbench.engine.sweep.run import finish, plan, run_sweep
from tqbench.engine.sweep.spec import MEASUREMENTS, SpecError, SweepSpec, load_spec, parse_spec
from tqbench.engine.sweep.store import SweepDir

__all__ = [
    "INSTALL_HINT",
    "MEASUREMENTS",
    "Cell",
    "RayMissing",
    "SpecError",
    "SweepCellFinished",
    "SweepCellStarted",
    "SweepDir",
    "SweepModelLoaded",
    "SweepPlanned",
    "SweepReport",
    "SweepSpec",
    "build_report",
    "check_ray",
    "expand",
    "finish",
    "load_spec",
    "numbers",
    "parse_spec",
    "plan",
    "run_sweep",
    "shards",
]
