"""One thread owns the model. Requests wait in a bounded queue; events flow back into the asyncio loop.

The model is not thread-safe, so exactly one worker thread runs ``Engine.stream`` for one request at a
time. Each job carries an asyncio queue; the worker pushes every engine event into it with
``loop.call_soon_threadsafe``. A job's ``cancelled`` flag is the engine's ``cancel`` callable: a client
that goes away sets it and the engine stops before its next decode step, freeing the slot.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import queue
import threading
import time
from dataclasses import dataclass, field

from tqbench.engine import Policy, Sampling


@dataclass(frozen=True)
class JobFailed:
    """The engine raised while running a job (pushed instead of ``GenerationFinished``)."""

    error: BaseException


@dataclass(frozen=True)
class JobStarted:
    """The worker took the job off the queue (pushed before the engine's own events)."""

    waited_seconds: float


END = object()  # last item a job's event queue receives


@dataclass
class Job:
    ids: object  # torch.Tensor [1, T]
    policy: Policy
    cache_mode: str
    max_new_tokens: int
    sampling: Sampling
    stop: list[str] | None
    stop_at_eos: bool
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    enqueued_at: float = field(default_factory=time.perf_counter)
    number: int = 0

    def push(self, item: object) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the loop is closed: the server is shutting down
            self.cancelled.set()


class QueueFull(Exception):
    def __init__(self, retry_after: int) -> None:
        super().__init__(f"queue full, retry after {retry_after}s")
        self.retry_after = retry_after


class ShuttingDown(Exception):
    pass


class Worker:
    """A daemon thread that runs queued jobs one at a time on ``engine``."""

    def __init__(self, engine, max_queue: int) -> None:
        if max_queue < 1:
            raise ValueError(f"max_queue={max_queue} is invalid: allow at least 1 waiting request")
        self.engine = engine
        self.max_queue = max_queue
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self._thread: threading.Thread | None = None
        self._counter = itertools.count(1)
        self._lock = threading.Lock()
        self.running: Job | None = None
        self.stats = {"completed": 0, "cancelled": 0, "failed": 0, "rejected": 0, "skipped": 0}
        self._avg_seconds = 1.0
        self.closing = False

    # -- lifecycle ----------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tqbench-serve-worker", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self.closing = True
        if self._thread is None:
            return
        job = self.running
        if job is not None:
            job.cancelled.set()
        while True:  # drop waiting jobs, then wake the thread with the sentinel
            try:
                waiting = self._queue.get_nowait()
            except queue.Empty:
                break
            if waiting is not None:
                waiting.cancelled.set()
                waiting.push(END)
        self._queue.put(None)
        self._thread.join(timeout)
        self._thread = None

    def cancel_all(self) -> None:
        """Stop the running generation and every waiting one (server shutdown): their streams end at once."""
        self.closing = True
        job = self.running
        if job is not None:
            job.cancelled.set()
        for j in self.waiting_jobs():
            j.cancelled.set()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def waiting(self) -> int:
        return self._queue.qsize()

    def waiting_jobs(self) -> list[Job]:
        """A snapshot of the jobs waiting behind the running one, in arrival order."""
        with self._queue.mutex:
            return [j for j in self._queue.queue if j is not None]

    # -- submission -----------------------------------------------------------------------------------
    def submit(self, job: Job) -> Job:
        """Queue ``job`` or raise ``QueueFull`` with a Retry-After estimate in seconds."""
        if self.closing:
            raise ShuttingDown()
        job.number = next(self._counter)
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            with self._lock:
                self.stats["rejected"] += 1
            raise QueueFull(self.retry_after()) from None
        return job

    def retry_after(self) -> int:
        """Seconds until a queue slot probably frees: one request leaves the queue per finished request."""
        return max(1, math.ceil(self._avg_seconds))

    # -- the thread -----------------------------------------------------------------------------------
    def _run(self) -> None:
        from tqbench.engine.events import GenerationFinished

        while True:
            job = self._queue.get()
            if job is None:
                return
            if job.cancelled.is_set():  # its client left while it waited
                self._count("skipped")
                job.push(END)
                continue
            self.running = job
            start = time.perf_counter()
            job.push(JobStarted(start - job.enqueued_at))
            outcome = "failed"
            try:
                for ev in self.engine.stream(
                    job.ids, job.policy, job.cache_mode, max_new_tokens=job.max_new_tokens,
                    sampling=job.sampling, stop=job.stop, stop_at_eos=job.stop_at_eos,
                    cancel=job.cancelled.is_set, run=f"request-{job.number}",
                ):
                    if isinstance(ev, GenerationFinished):
                        outcome = "cancelled" if ev.result.stopped_by == "cancelled" else "completed"
                    job.push(ev)
            except Exception as exc:  # a failed request never takes the worker down
                job.push(JobFailed(exc))
            finally:
                self._count(outcome)
                self.running = None
                elapsed = time.perf_counter() - start
                self._avg_seconds = 0.8 * self._avg_seconds + 0.2 * elapsed
                job.push(END)

    def _count(self, key: str) -> None:
        with self._lock:
            self.stats[key] += 1
