"""A sweep on a Ray cluster: one task per (model, shard of cells), the model loaded once per task.

Resources: on a cluster with GPUs every task asks for one GPU (``num_gpus=1``, so Ray pins it to one device);
without GPUs a task asks for ``threads`` CPUs (the spec's ``threads``, default 1). The number of shards per model
is the spec's ``[ray] shards_per_model``, else the cluster's task slots (GPUs, or CPUs / threads) shared between
the models. What moves between nodes: the spec and the shard's cells to the worker (a few KB; the policies
travel as their parsed dataclasses), the model is loaded by each worker from its own disk or hub cache, and each
finished cell comes back through a ``ray.util.queue.Queue`` (JSON-safe dict + small numpy arrays); the driver
writes every file, so workers need no shared disk. Progress streams back through the same queue.
"""

from __future__ import annotations

import platform

from tqbench.engine.events import CancelFlag, Cancelled
from tqbench.engine.request import RequestError
from tqbench.engine.sweep.cells import Cell, shards
from tqbench.engine.sweep.spec import SweepSpec

INSTALL_HINT = ("a sweep on Ray needs Ray, which is not installed: pip install 'tqbench[ray]' (or pip install ray), "
                "then run the sweep again")


class RayMissing(ValueError):
    pass


def check_ray() -> None:
    try:
        import ray  # noqa: F401
    except ImportError:
        raise RayMissing(INSTALL_HINT) from None


def task_options(resources: dict, threads: int | None) -> tuple[dict, int]:
    """(Ray task options, task slots) for a cluster's ``resources``: one GPU per task where there are GPUs
    (with up to ``threads`` of the CPUs per GPU), else ``threads`` CPUs (default 1) per task."""
    gpus, cpus = int(resources.get("GPU", 0)), int(resources.get("CPU", 1))
    threads = threads or 1
    if gpus:
        return {"num_gpus": 1, "num_cpus": min(threads, max(1, cpus // gpus))}, gpus
    if threads > cpus:  # the task could never be scheduled: say so instead of waiting forever
        raise RequestError("threads", threads, f"the Ray cluster has {cpus} CPUs and no GPUs: use at most the CPUs "
                                               "of one node")
    return {"num_cpus": threads}, max(1, cpus // threads)


def _shard(spec: SweepSpec, model, cells: list[Cell], queue, device: str | None) -> int:
    """The Ray task: ``run_cells`` with every message put on the driver's queue."""
    import ray

    from tqbench.engine.sweep.worker import run_cells

    node = ray.get_runtime_context().get_node_id()[:8]
    run_cells(spec, model, cells, queue.put, where=f"ray node {node} ({platform.node()})", device=device)
    return len(cells)


def _drain(queue, driver) -> None:
    from ray.util.queue import Empty

    while True:
        try:
            msg = queue.get_nowait()
        except Empty:
            return
        driver(msg)


def run_on_ray(spec: SweepSpec, todo: list[Cell], driver, address: str | None, cancel: CancelFlag | None,
               planned) -> None:
    """Run ``todo`` on Ray; ``driver`` gets every worker message; ``planned(n_shards)`` once tasks are queued."""
    check_ray()
    import ray
    from ray.util.queue import Empty, Queue

    started_here = not ray.is_initialized()
    if started_here:  # an address connects to that cluster; none: a running local one, else a new local one
        ray.init(address=address or None, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
    try:
        opts, slots = task_options(ray.cluster_resources(), spec.threads)
        device = None  # "auto": the GPU Ray gave the task, else the CPU
        by_model = [(m, [c for c in todo if c.model == m]) for m in spec.models]
        by_model = [(m, cs) for m, cs in by_model if cs]
        per_model = spec.shards_per_model or max(1, slots // max(1, len(by_model)))
        queue = Queue(actor_options={"num_cpus": 0})
        task = ray.remote(_shard)
        pending = {}
        for model, cells in by_model:
            for shard in shards(cells, per_model):
                pending[task.options(**opts).remote(spec, model, shard, queue, device)] = shard
        planned(len(pending))
        while pending:
            if cancel is not None and cancel():
                for ref in pending:
                    ray.cancel(ref, force=True)
                raise Cancelled("sweep cancelled")
            try:
                driver(queue.get(timeout=0.5))
            except Empty:
                pass
            _drain(queue, driver)
            ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=0)
            for ref in ready:
                shard = pending.pop(ref)
                try:
                    ray.get(ref)
                except Exception as exc:  # the worker died: its unfinished cells are recorded as failed
                    _drain(queue, driver)
                    for c in shard:
                        if c.cell_id not in driver.finished:
                            driver(("finished", c.cell_id, {
                                "cell": c.key(spec), "status": "error", "where": "ray",
                                "error": {"type": type(exc).__name__,
                                          "message": f"the Ray task died: {str(exc).splitlines()[0]}"}}, {}))
        _drain(queue, driver)
    finally:
        if started_here:
            ray.shutdown()
