"""One thread owns the model. Requests wait in a bounded queue; events flow back into the asyncio loop.

The model is not thread-safe, so exactly one worker thread runs it. Requests that share a KV policy and a
cache mode decode together: each keeps its own cache (``Engine.sequence``), and every step runs one forward
call over all of them (``Engine.decode_step``). A request joins the batch between steps (its prefill runs
alone, then it decodes with the others) and leaves when it finishes; up to ``max_batch`` decode at once.
Requests of another policy or mode wait their turn in arrival order: once the oldest waiting request needs a
different batch, no newer request joins the current one, and the next batch starts when it drains.
With a KV budget (``kv_budget`` bytes, ``server.admission``) a request joins only when its reserved cache bytes
(``Job.kv_bytes``) fit beside the running ones; until then it waits, and nothing newer overtakes it.

Each job carries an asyncio queue; the worker pushes every engine event into it with
``loop.call_soon_threadsafe``. A job's ``cancelled`` flag is checked before each of its steps: a client that
goes away stops its generation at the next step, freeing its place in the batch.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import math
import threading
import time
from dataclasses import dataclass, field

from tqbench.engine import Policy, Sampling

DEFAULT_MAX_BATCH = 8
RATE_WINDOW_SECONDS = 10.0  # tokens/s gauges average over this window
KV_REFRESH_SECONDS = 1.0  # resident KV bytes are re-read from the caches at most this often


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
    logprobs: int | None = None  # top alternatives per token (0: the token's own logprob only); None: off
    echo: bool = False  # score the prompt's tokens too
    prefill_chunk: int = 0
    kv_bytes: int = 0  # its cache at prompt + max_new_tokens under its policy (the admission's reservation)
    #: the prefix cache (``server.prefix``): ``prefix`` > 0 names the shareable prefix's length (its first tokens,
    #: compressed once and stored); ``prefix_auto``: reuse the longest stored prefix of ``ids``, store nothing
    prefix: int = 0
    prefix_auto: bool = False
    prefix_use: object = None  # the PrefixUse the worker recorded (read once the job's GenerationFinished arrives)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    enqueued_at: float = field(default_factory=time.perf_counter)
    number: int = 0

    @property
    def batch_key(self) -> tuple[str, str]:
        return self.policy.label, self.cache_mode

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


@dataclass(eq=False)
class _Running:
    job: Job
    seq: object = None  # the engine's Sequence, once created
    started: float = 0.0


class Worker:
    """A daemon thread that runs queued jobs on ``engine``, decoding compatible ones in one batch."""

    def __init__(self, engine, max_queue: int, max_batch: int = DEFAULT_MAX_BATCH, kv_budget: int | None = None,
                 prefix_cache=None) -> None:
        if max_queue < 1:
            raise ValueError(f"max_queue={max_queue} is invalid: allow at least 1 waiting request")
        if max_batch < 1:
            raise ValueError(f"max_batch={max_batch} is invalid: allow at least 1 request per batch")
        self.engine = engine
        self.max_queue = max_queue
        self.max_batch = max_batch
        self.kv_budget = kv_budget  # bytes the running requests' caches may reserve together (None: no bound)
        self.prefix_cache = prefix_cache  # server.prefix.PrefixCache (None: no prefix cache)
        self.kv_reserved = 0  # bytes reserved by the running requests (their kv_bytes)
        self._waiting: collections.deque[Job] = collections.deque()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._counter = itertools.count(1)
        self._lock = threading.Lock()
        self._running: list[_Running] = []
        self._stopping = False
        self.stats = {"completed": 0, "cancelled": 0, "failed": 0, "rejected": 0, "skipped": 0}
        # what /metrics exports (written by the worker thread, read by the server)
        self.counters = {"prompt_tokens": 0, "generated_tokens": 0, "decode_steps": 0, "decode_rows": 0,
                         "prefill_seconds": 0.0, "decode_seconds": 0.0}
        self.batch_size = 0  # sequences in the last decode step
        self.batch_key: tuple[str, str] | None = None
        self.unbatched_reason: str | None = None  # why the current batch's kind decodes one at a time
        self.kv_bytes = {"resident": 0, "packed": 0, "dense_fp16": 0}
        self._kv_read_at = 0.0
        self._recent: collections.deque[tuple[float, int]] = collections.deque()  # (time, tokens) per step
        self._avg_seconds = 1.0
        self.closing = False

    # -- lifecycle ----------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._stopping = False
            self._thread = threading.Thread(target=self._run, name="tqbench-serve-worker", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self.closing = True
        if self._thread is None:
            return
        for r in list(self._running):
            r.job.cancelled.set()
        with self._cond:
            while self._waiting:  # drop waiting jobs, then wake the thread
                waiting = self._waiting.popleft()
                waiting.cancelled.set()
                waiting.push(END)
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout)
        self._thread = None

    def cancel_all(self) -> None:
        """Stop the running generations and every waiting one (server shutdown): their streams end at once."""
        self.closing = True
        for r in list(self._running):
            r.job.cancelled.set()
        for j in self.waiting_jobs():
            j.cancelled.set()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def running(self) -> list[Job] | None:
        """The jobs the engine is running now (prefilling or in the decode batch); None when idle."""
        jobs = [r.job for r in list(self._running)]
        return jobs or None

    def running_by_policy(self) -> dict[str, tuple[int, int]]:
        """policy label -> (running requests, KV bytes they reserve)."""
        out: dict[str, tuple[int, int]] = {}
        for r in list(self._running):
            n, b = out.get(r.job.policy.label, (0, 0))
            out[r.job.policy.label] = (n + 1, b + r.job.kv_bytes)
        return out

    def waiting_by_policy(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for j in self.waiting_jobs():
            out[j.policy.label] = out.get(j.policy.label, 0) + 1
        return out

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def waiting_jobs(self) -> list[Job]:
        """A snapshot of the jobs waiting behind the running ones, in arrival order."""
        with self._cond:
            return list(self._waiting)

    def tokens_per_second(self) -> float:
        """Tokens generated per second over the last ``RATE_WINDOW_SECONDS`` (0 when idle that long)."""
        now = time.perf_counter()
        recent = [(t, n) for t, n in list(self._recent) if now - t <= RATE_WINDOW_SECONDS]
        if not recent:
            return 0.0
        span = max(now - recent[0][0], 1e-9) if len(recent) > 1 else RATE_WINDOW_SECONDS
        return sum(n for _, n in recent) / span

    # -- submission -----------------------------------------------------------------------------------
    def submit(self, job: Job) -> Job:
        """Queue ``job`` or raise ``QueueFull`` with a Retry-After estimate in seconds."""
        if self.closing:
            raise ShuttingDown()
        with self._cond:
            if len(self._waiting) >= self.max_queue:
                with self._lock:
                    self.stats["rejected"] += 1
                raise QueueFull(self.retry_after())
            job.number = next(self._counter)
            self._waiting.append(job)
            self._cond.notify_all()
        return job

    def retry_after(self) -> int:
        """Seconds until a queue slot probably frees: a request's average time over the requests run at once."""
        return max(1, math.ceil(self._avg_seconds / max(1, len(self._running))))

    # -- the thread -----------------------------------------------------------------------------------
    def _admit(self) -> list[Job]:
        """Jobs to start now (called with the condition held): FIFO, same batch kind as the running ones."""
        out: list[Job] = []
        key = self._running[0].job.batch_key if self._running else None
        if self._running and self.unbatched_reason is not None:
            return out
        # an idle worker starts one job: whether its kind batches is known once its cache exists
        room = self.max_batch - len(self._running) if self._running else 1
        reserved = self.kv_reserved
        while self._waiting and len(out) < room:
            job = self._waiting[0]
            if job.cancelled.is_set():  # its client left while it waited
                self._waiting.popleft()
                self._count("skipped")
                job.push(END)
                continue
            if key is None:
                key = job.batch_key
            elif job.batch_key != key:
                break  # it waits for this batch to drain; nothing newer overtakes it
            if self.kv_budget is not None and (out or self._running) and reserved + job.kv_bytes > self.kv_budget:
                break  # its cache does not fit beside the running ones yet: it waits (FIFO)
            self._waiting.popleft()
            reserved += job.kv_bytes
            out.append(job)
        return out

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._running and not self._stopping:
                    self._cond.wait()
                if self._stopping and not self._running:
                    return
                admitted = self._admit()
                running = [_Running(job, None, time.perf_counter()) for job in admitted]
                self._running.extend(running)
                self.kv_reserved += sum(job.kv_bytes for job in admitted)
            for r in running:
                self._start(r)
            self._step()

    def _start(self, r: _Running) -> None:
        """Create the job's sequence and prefill it (alone); it decodes with the batch from the next step."""
        from tqbench.engine.batch import why_not_batched

        job = r.job
        job.push(JobStarted(r.started - job.enqueued_at))
        try:
            if job.cache_mode == "fused":  # installs the fused attention once (plain tensors keep the old path)
                self.engine.enable_fused()
            context = self._prefix_context(job)
            if context is not None:
                self._reserve_from(job, context.tokens)
            ids = job.ids if context is None else job.ids[:, context.tokens:]
            r.seq = self.engine.sequence(
                ids, job.policy, job.cache_mode, max_new_tokens=job.max_new_tokens, sampling=job.sampling,
                stop=job.stop, stop_at_eos=job.stop_at_eos, cancel=job.cancelled.is_set,
                run=f"request-{job.number}", logprobs=job.logprobs, echo=job.echo, prefill_chunk=job.prefill_chunk,
                context=context,
            )
            if len(self._running) == 1 or self.batch_key != job.batch_key:
                self.batch_key = job.batch_key
                self.unbatched_reason = why_not_batched(r.seq.cache)
            events = r.seq.start()
        except Exception as exc:  # a failed request never takes the worker down
            self._fail(r, exc)
            return
        use = job.prefix_use
        fresh = use is not None and not use.hit  # its prefix was compressed for it: prefilled tokens and time
        self.counters["prompt_tokens"] += int(r.seq.ids.shape[1]) + (use.tokens if fresh else 0)
        self.counters["prefill_seconds"] += r.seq.result.prefill_seconds + (use.compress_seconds if fresh else 0.0)
        self._push(r, events)

    def _prefix_context(self, job: Job):
        """The compressed prefix ``job`` starts from (a ``CompressedContext``), or None; records ``job.prefix_use``.
        A named prefix is compressed now when it is not stored (its time is the request's prefill's)."""
        cache = self.prefix_cache
        if cache is None or not cache.enabled or not (job.prefix or job.prefix_auto):
            return None
        if job.prefix:
            entry, job.prefix_use = cache.get_or_compress(self.engine, job.policy, job.cache_mode,
                                                          job.ids[:, :job.prefix], job.prefill_chunk)
            return entry.context
        entry = cache.longest(job.policy.label, job.cache_mode, tuple(job.ids[0].tolist()))
        if entry is None:
            return None
        job.prefix_use = cache.used(entry)
        return entry.context

    def _reserve_from(self, job: Job, cut: int) -> None:
        """Raise the job's reservation to its cache appended to a ``cut``-token prefix when that holds more (an
        evicting policy's: ``request_kv_bytes(prefix=)``; the prefix found may not be the one admission saw)."""
        from tqbench.server.admission import request_kv_bytes

        n = int(job.ids.shape[1])
        need = request_kv_bytes(job.policy, self.engine.geometry, n + job.max_new_tokens, prompt=n, prefix=cut)
        if need > job.kv_bytes:
            with self._cond:
                self.kv_reserved += need - job.kv_bytes
                job.kv_bytes = need

    def _step(self) -> None:
        """Each running sequence picks its next token; then one forward call over those that go on."""
        for r in list(self._running):
            if r.seq is None or r.seq.done:
                continue
            try:
                events = r.seq.step()
            except Exception as exc:
                self._fail(r, exc)
                continue
            self._push(r, events)
        going = [r for r in self._running if r.seq is not None and not r.seq.done]
        if not going:
            return
        try:
            seconds = self.engine.decode_step([r.seq for r in going])
        except Exception as exc:  # the batch's forward call failed: every request in it failed
            for r in going:
                self._fail(r, exc)
            return
        n = len(going)
        now = time.perf_counter()
        self.batch_size = n
        self.counters["decode_steps"] += 1
        self.counters["decode_rows"] += n
        self.counters["decode_seconds"] += seconds
        self._recent.append((now, n))
        while self._recent and now - self._recent[0][0] > RATE_WINDOW_SECONDS:
            self._recent.popleft()
        if now - self._kv_read_at >= KV_REFRESH_SECONDS:
            self._read_kv_bytes(going)

    def _read_kv_bytes(self, running: list[_Running]) -> None:
        totals = {"resident": 0, "packed": 0, "dense_fp16": 0}
        for r in running:
            rep = r.seq.cache.report()
            totals["resident"] += rep.resident_decode_bytes
            totals["packed"] += rep.compressed_storage_bytes
            totals["dense_fp16"] += rep.dense_fp16_bytes
        self.kv_bytes = totals
        self._kv_read_at = time.perf_counter()

    def _push(self, r: _Running, events: list) -> None:
        from tqbench.engine.events import GenerationFinished, TokenGenerated

        for ev in events:
            if isinstance(ev, TokenGenerated):
                self.counters["generated_tokens"] += 1
            r.job.push(ev)
            if isinstance(ev, GenerationFinished):
                self._end(r, "cancelled" if ev.result.stopped_by == "cancelled" else "completed")

    def _fail(self, r: _Running, exc: BaseException) -> None:
        r.job.push(JobFailed(exc))
        self._end(r, "failed")

    def _end(self, r: _Running, outcome: str) -> None:
        self._count(outcome)
        elapsed = time.perf_counter() - r.started
        self._avg_seconds = 0.8 * self._avg_seconds + 0.2 * elapsed
        with self._cond:
            if r in self._running:
                self._running.remove(r)
                self.kv_reserved -= r.job.kv_bytes
            if not self._running:
                self.batch_size = 0
                self.kv_bytes = {"resident": 0, "packed": 0, "dense_fp16": 0}
        r.job.push(END)

    def _count(self, key: str) -> None:
        with self._lock:
            self.stats[key] += 1
