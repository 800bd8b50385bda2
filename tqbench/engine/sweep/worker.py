"""What one sweep worker does (in-process, or inside a Ray task): load the model once, run its cells in order,
send each result to the driver. A raising cell is recorded (type, message, traceback tail) and the next runs;
a model that does not load records that error on every cell of the shard."""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable

from tqbench.engine.events import CancelFlag, Cancelled, raise_if_cancelled
from tqbench.engine.sweep.cells import Cell
from tqbench.engine.sweep.spec import ModelEntry, SweepSpec

#: what a worker sends the driver: ("loaded", model spec, name, where) | ("started", cell id, where)
#: | ("finished", cell id, document, arrays)
Send = Callable[[tuple], None]


def _error(exc: BaseException) -> dict:
    tb = traceback.format_exception(type(exc), exc, exc.__traceback__)
    return {"type": type(exc).__name__, "message": str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
            "traceback": "".join(tb)[-4000:]}


def run_cells(spec: SweepSpec, model: ModelEntry, cells: list[Cell], send: Send, cancel: CancelFlag | None = None,
              where: str = "in-process", device: str | None = None, engine=None) -> None:
    """One worker's job: load ``model`` once (or use ``engine``, already loaded), run ``cells`` in order,
    ``send`` each result."""
    from tqbench.engine.engine import Engine
    from tqbench.engine.sweep.measure import CellRunner

    raise_if_cancelled(cancel, "sweep")
    try:
        if engine is None:
            engine = Engine.load(model.spec, device=device or model.device, dtype=model.dtype, threads=spec.threads)
    except Exception as exc:  # every cell of this model records why it could not run
        err = _error(exc)
        err["message"] = f"model {model.spec!r} did not load: {err['message']}"
        for c in cells:
            send(("finished", c.cell_id, {"cell": c.key(spec), "status": "error", "error": err,
                                          "where": where}, {}))
        return
    info = engine.loaded
    send(("loaded", model.spec, info.name, where))
    runner = CellRunner(engine, spec, cancel)
    import torch

    for c in cells:
        raise_if_cancelled(cancel, "sweep")
        send(("started", c.cell_id, where))
        t0 = time.perf_counter()
        doc = {"cell": c.key(spec), "model_name": info.name, "model_fingerprint": info.fingerprint,
               "device": str(info.device), "dtype": str(info.dtype).replace("torch.", ""),
               "threads": torch.get_num_threads(), "where": where}
        arrays = {}
        try:
            out = runner.run(c)
            doc.update(status="ok", results=out.results, recommendation=out.recommendation)
            arrays = out.arrays
        except Cancelled:
            raise
        except Exception as exc:  # recorded; the sweep goes on
            doc.update(status="error", error=_error(exc))
        doc["seconds"] = round(time.perf_counter() - t0, 3)
        send(("finished", c.cell_id, doc, arrays))
