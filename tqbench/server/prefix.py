"""The prefix cache (``tqbench serve --prefix-cache SIZE``): a shared prefix compressed once, reused by every
request that starts with it.

A request names where its shareable prefix ends (the ``cache_prefix`` extension: a chat's leading system
messages, the first N messages, a completion's leading text or first N tokens). The worker looks the prefix's
token ids up under the request's KV policy and cache mode; on a miss it prefills and compresses them once
(``Engine.compress``: an evicting policy applies its keep at the end of the prefix, before any question: the
query-agnostic protocol) and stores the ``CompressedContext``; on a hit the prefix is neither prefilled nor scored
again. Either way the request's own tokens are appended to a private copy of the compressed prefix
(``CompressedContext.fork``), so the stored entry never changes and a request in flight never sees an eviction.
A request that names no prefix still reuses the longest stored prefix of its tokens (same policy and mode),
as vLLM's automatic prefix caching does; ``"cache_prefix": false`` opts out.

Entries are keyed by (policy label, cache mode, token ids), counted by the bytes their compressed cache holds
(the cache report's ``compressed_storage_bytes``, every byte of metadata included), and evicted least recently
used first once the total would pass the cap. Only the worker thread reads or writes entries; the counters are
read by ``/metrics`` and ``/health`` under the lock.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import threading
import time
from dataclasses import dataclass, field

from tqbench.engine.cache import parse_bytes

__all__ = ["DEFAULT_PREFIX_CACHE", "PrefixCache", "PrefixUse", "prefix_key"]

DEFAULT_PREFIX_CACHE = "256MiB"
log = logging.getLogger("uvicorn.error")  # uvicorn prints it at --log-level (the server's own log)


def prefix_key(ids) -> str:
    """A short stable name of a prefix's token ids (the log's and the responses' ``key``)."""
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:12]


@dataclass
class Entry:
    context: object  # the CompressedContext
    ids: tuple[int, ...]
    policy: str
    cache_mode: str
    bytes: int
    key: str
    compress_seconds: float
    hits: int = 0
    created: float = field(default_factory=time.time)


@dataclass(frozen=True)
class PrefixUse:
    """How one request used the prefix cache (its response's ``tqbench.prefix_cache``)."""

    tokens: int  # prefix tokens read from the compressed context (0: none)
    hit: bool  # True: the compressed prefix was already stored (not prefilled again)
    key: str | None
    bytes: int  # the compressed prefix's bytes (stored once, however many requests read it)
    compress_seconds: float  # the prefill + compression of the prefix (on a hit: when it was stored)
    stored: bool  # the entry is in the cache after this request
    reason: str | None = None  # why nothing was stored or read (too big for the cap, cache off ...)

    def to_dict(self) -> dict:
        return {"tokens": self.tokens, "hit": self.hit, "key": self.key, "bytes": self.bytes,
                "compress_seconds": round(self.compress_seconds, 6), "stored": self.stored, "reason": self.reason}


class PrefixCache:
    """Compressed prefixes under a byte cap, least recently used evicted first (``cap`` 0: off)."""

    def __init__(self, cap: int | str | None = DEFAULT_PREFIX_CACHE) -> None:
        self.cap = parse_bytes(cap, "prefix cache size") if isinstance(cap, str) else int(cap or 0)
        if self.cap < 0:
            raise ValueError(f"prefix cache {self.cap} bytes is invalid: give a size like 256MiB, or 0 for off")
        self._entries: collections.OrderedDict[tuple, Entry] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.total_bytes = 0
        self.counters = {"hits": 0, "misses": 0, "stored": 0, "evicted": 0, "too_big": 0, "hit_tokens": 0,
                         "compressed_tokens": 0}

    @property
    def enabled(self) -> bool:
        return self.cap > 0

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> list[Entry]:
        with self._lock:
            return list(self._entries.values())

    def longest(self, policy: str, mode: str, ids: tuple[int, ...], touch: bool = True) -> Entry | None:
        """The longest stored prefix of ``ids`` (shorter than ``ids``: at least one token is left to prefill)
        under ``policy`` and ``mode``; with ``touch`` it becomes the most recently used."""
        best = None
        with self._lock:
            for e in self._entries.values():
                n = len(e.ids)
                if (e.policy, e.cache_mode) == (policy, mode) and n < len(ids) and ids[:n] == e.ids and (
                        best is None or n > len(best.ids)):
                    best = e
            if best is not None and touch:
                self._entries.move_to_end((best.policy, best.cache_mode, best.ids))
        return best

    def get_or_compress(self, engine, policy, mode: str, ids, prefill_chunk: int | None) -> tuple[Entry, PrefixUse]:
        """The entry for exactly ``ids`` (a ``[1, N]`` tensor) under ``policy``/``mode``: the stored one (a hit),
        else compressed now (``Engine.compress``) and stored when it fits the cap (evicting LRU entries)."""
        key_ids = tuple(int(t) for t in ids[0].tolist())
        k = (policy.label, mode, key_ids)
        with self._lock:
            entry = self._entries.get(k)
            if entry is not None:
                self._entries.move_to_end(k)
        if entry is not None:
            return entry, self.used(entry)
        t0 = time.perf_counter()
        ctx = engine.compress(ids, policy, mode, prefill_chunk=prefill_chunk)
        seconds = time.perf_counter() - t0
        entry = Entry(ctx, key_ids, policy.label, mode, int(ctx.report().compressed_storage_bytes),
                      prefix_key(key_ids), seconds)
        reason = self._store(k, entry)
        with self._lock:
            self.counters["misses"] += 1
            self.counters["compressed_tokens"] += len(key_ids)
        return entry, PrefixUse(len(key_ids), False, entry.key, entry.bytes, seconds, reason is None, reason)

    def used(self, entry: Entry) -> PrefixUse:
        """Count a hit on ``entry`` (its tokens are read, not prefilled)."""
        with self._lock:
            entry.hits += 1
            self.counters["hits"] += 1
            self.counters["hit_tokens"] += len(entry.ids)
        log.info("prefix cache: hit %s (%d tokens, %d bytes, %s, %s; hit %d times)", entry.key, len(entry.ids),
                 entry.bytes, entry.policy, entry.cache_mode, entry.hits)
        return PrefixUse(len(entry.ids), True, entry.key, entry.bytes, entry.compress_seconds, True)

    def _store(self, k: tuple, entry: Entry) -> str | None:
        """Store ``entry``, evicting the least recently used ones to fit; the reason it was not stored, or None."""
        if entry.bytes > self.cap:
            with self._lock:
                self.counters["too_big"] += 1
            reason = (f"the compressed prefix takes {entry.bytes} bytes, more than the whole prefix cache of "
                      f"{self.cap} bytes (tqbench serve --prefix-cache): it was used once and not stored")
            log.info("prefix cache: not stored %s: %s", entry.key, reason)
            return reason
        evicted = []
        with self._lock:
            while self._entries and self.total_bytes + entry.bytes > self.cap:
                _, old = self._entries.popitem(last=False)
                self.total_bytes -= old.bytes
                self.counters["evicted"] += 1
                evicted.append(old)
            self._entries[k] = entry
            self.total_bytes += entry.bytes
            self.counters["stored"] += 1
            count, total = len(self._entries), self.total_bytes
        for old in evicted:
            log.info("prefix cache: evicted %s (%d tokens, %d bytes, least recently used; hit %d times)", old.key,
                     len(old.ids), old.bytes, old.hits)
        log.info("prefix cache: stored %s (%d tokens, %d bytes, %s, %s, compressed in %.3fs); %d entries, %d of "
                 "%d bytes", entry.key, len(entry.ids), entry.bytes, entry.policy, entry.cache_mode,
                 entry.compress_seconds, count, total, self.cap)
        return None

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.total_bytes = 0

    def stats(self) -> dict:
        """What ``/health`` shows (and ``/metrics`` exports)."""
        with self._lock:
            return {"enabled": self.enabled, "cap_bytes": self.cap, "entries": len(self._entries),
                    "bytes": self.total_bytes, **self.counters,
                    "prefixes": [{"key": e.key, "tokens": len(e.ids), "bytes": e.bytes, "kv_policy": e.policy,
                                  "cache_mode": e.cache_mode, "hits": e.hits} for e in self._entries.values()]}
