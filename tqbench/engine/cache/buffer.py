"""``GrowBuffer``: a tensor that grows along dim 2 (tokens) with amortised doubling, for a store's rows."""

from __future__ import annotations

import torch


class GrowBuffer:
    """A tensor that grows along dim 2 with amortised doubling; ``drop_front`` only moves a start offset.

    Views handed out earlier stay valid: rows are only ever written past the current end, and a buffer that
    runs out of room is copied into a new tensor (never compacted in place). ``drop_back`` (a crop) makes the
    rows past the new end writable again: views of them taken before the crop must not be read after it.
    ``state()`` / ``restore()`` take the buffer back to an earlier point (its tensor, start and length)."""

    __slots__ = ("_bytes", "_view", "data", "n", "start")

    def __init__(self) -> None:
        self.data: torch.Tensor | None = None
        self.n = 0
        self.start = 0
        self._bytes: tuple | None = None  # (data, its bytes): ``alloc_bytes`` is asked every decode step
        self._view: tuple | None = None  # (data, start, n, the view): a buffer that did not change (sinks) is not sliced again

    def append(self, x: torch.Tensor) -> None:
        t = x.shape[2]
        if t == 0:
            return
        if self.data is None:
            shape = list(x.shape)
            shape[2] = max(t, 16)
            self.data, self.start = x.new_empty(shape), 0
        end = self.reserve(t)
        self.data[:, :, end : end + t] = x

    def reserve(self, t: int) -> int:
        """Room for ``t`` more rows (the buffer exists): they now count as held; returns the offset in ``data`` of
        the first, for the caller to write them there (the native append path writes packed rows in place)."""
        if self.start + self.n + t > self.data.shape[2]:
            shape = list(self.data.shape)
            shape[2] = max(self.n + t, 2 * shape[2]) if self.start == 0 else max(16, 2 * (self.n + t))
            grown = self.data.new_empty(shape)
            grown[:, :, : self.n] = self.data[:, :, self.start : self.start + self.n]
            self.data, self.start = grown, 0
        end = self.start + self.n
        self.n += t
        return end

    def view(self) -> torch.Tensor | None:
        data = self.data
        if data is None:
            return None
        hit = self._view
        if hit is None or hit[0] is not data or hit[1] != self.start or hit[2] != self.n:
            hit = self._view = (data, self.start, self.n, data[:, :, self.start : self.start + self.n])
        return hit[3]

    def drop_front(self, t: int) -> None:
        if t <= 0:
            return
        t = min(t, self.n)
        self.start += t
        self.n -= t

    def drop_back(self, t: int) -> None:
        self.n -= max(0, min(t, self.n))

    def state(self) -> tuple:
        return self.data, self.n, self.start

    def restore(self, state: tuple) -> None:
        self.data, self.n, self.start = state

    def alloc_bytes(self) -> int:
        """Bytes of the tensor allocated (its capacity, not just the rows in use)."""
        data = self.data
        if data is None:
            return 0
        hit = self._bytes
        if hit is None or hit[0] is not data:
            hit = self._bytes = (data, data.numel() * data.element_size())
        return hit[1]

    def nbytes(self) -> int:
        if self.data is None:
            return 0
        per_unit = self.data[:, :, :1].numel() * self.data.element_size()
        return per_unit * self.n

    def select_batch(self, index: torch.Tensor) -> None:
        if self.data is not None:
            self.data = self.data.index_select(0, index.to(self.data.device))

    def repeat_batch(self, repeats: int) -> None:
        if self.data is not None:
            self.data = self.data.repeat_interleave(repeats, dim=0)
