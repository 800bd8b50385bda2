"""The KV byte budget (``tqbench serve --kv-budget``): memory, not a request count, bounds concurrency.

A request is admitted when its cache at ``prompt + max_tokens`` tokens under its own policy (the engine's
exact byte estimate, ``estimate_kv``: packed rows, full-precision sink/recent rows and every byte of codec
metadata) fits beside the caches of the requests already running; otherwise it waits in the queue (first in,
first out: nothing newer overtakes it), and the queue's bound gives 429. A request whose cache could never fit
the whole budget is refused with a 400 at once.

The default budget is ``DEFAULT_KV_SHARE`` of the memory available once the model is loaded (``MemAvailable``
from ``/proc/meminfo`` on CPU, the device's free memory on CUDA); ``tqbench serve`` prints it at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass

from tqbench.constants import DEFAULT_KV_SHARE
from tqbench.engine.cache import estimate_kv, parse_bytes
from tqbench.engine.policy import parse_policy

__all__ = ["DEFAULT_KV_SHARE", "KVBudget", "available_memory", "parse_bytes", "request_kv_bytes"]


@dataclass(frozen=True)
class KVBudget:
    """The budget in bytes and where it came from (printed at start-up, shown in ``/health``)."""

    bytes: int
    source: str

    def __post_init__(self) -> None:
        if self.bytes < 1:
            raise ValueError(f"kv budget {self.bytes} bytes is invalid: give a size like 512MiB")

    @classmethod
    def resolve(cls, text: str | int | None, device_type: str = "cpu") -> KVBudget:
        """``--kv-budget`` as given (``512MiB``, ``2GB``, a byte count), or the default share of free memory."""
        if text is None or text == "auto":
            free, where = available_memory(device_type)
            return cls(int(free * DEFAULT_KV_SHARE), f"{DEFAULT_KV_SHARE:.0%} of the {free / 2**20:.0f} MiB "
                       f"available beside the model ({where})")
        if isinstance(text, int):
            return cls(text, "--kv-budget")
        return cls(parse_bytes(text), f"--kv-budget {text}")


def available_memory(device_type: str = "cpu") -> tuple[int, str]:
    """(bytes available now, where the figure comes from)."""
    if device_type == "cuda":
        import torch

        free, _ = torch.cuda.mem_get_info()
        return int(free), "torch.cuda.mem_get_info"
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"
    except OSError:
        pass
    import os

    pages = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(pages), "sysconf available pages"


def request_kv_bytes(policy, geometry, tokens: int, prompt: int | None = None, prefix: int = 0) -> int:
    """The most bytes one sequence's cache holds on its way to ``tokens`` tokens under ``policy``, ``prompt`` of
    them prefilled (default: all). A policy that evicts tokens (keep) holds its evicted size: decoded rows add
    up until the next eviction point (``every``), so the peak is at the end or just before the last point.
    ``prefix`` > 0: the prompt is appended to a compressed prefix of that many tokens (``server.prefix``), where an
    evicting policy kept its rows at the prefix's end and keeps every row after it: the larger of the two figures
    (a policy that keeps every row: its bytes depend on the token count alone)."""
    tokens = max(1, tokens)
    prompt = tokens if prompt is None else max(1, min(prompt, tokens))
    pol = parse_policy(policy)
    if prefix and pol.evicts:
        return max(request_kv_bytes(pol, geometry, tokens, prompt), request_kv_bytes(pol, geometry, tokens, prefix))
    ends = {tokens}
    if pol.evicts and pol.every and tokens - prompt >= pol.every:
        ends.add(prompt + (tokens - prompt) // pol.every * pol.every - 1)
    return max(int(estimate_kv(pol, geometry, n, prefill=prompt).total_bytes) for n in ends)
