"""Per-layer storage of K (or V) rows: full-precision sinks, packed history, full-precision recent tail.

Token order inside a store is ``[sink rows][packed rows][tail rows]``. New rows go to the sinks until
``sink`` rows are held, then to the tail; whenever the tail holds more than ``recent`` rows, its oldest
rows are encoded into the packed history, in multiples of the codec's ``tokens_per_unit`` (so a
per-channel codec keeps a partial block in full precision until it fills). The byte cost is therefore a
pure function of the token count, which ``estimate.py`` reproduces exactly.

A window-bounded store (a sliding-window layer's: ``window`` = the rows attention can still read) drops
its oldest rows before packing new ones: the rows before ``floor((seen - window) / align) * align``, whole
codec units at positions aligned to ``align`` (K and V of a layer share it), so it holds between
``window`` and ``window + align - 1`` rows, again a pure function of the token count (``window_start``).
"""

from __future__ import annotations

import torch

from tqbench.engine.codecs.base import Codec

#: full-precision rows (sinks, recent window, partial blocks) are counted as fp16, the deployment dtype
FP_BYTES = 2


class GrowBuffer:
    """A tensor that grows along dim 2 with amortised doubling; ``drop_front`` only moves a start offset.

    Views handed out earlier stay valid: rows are only ever written past the current end, and a buffer that
    runs out of room is copied into a new tensor (never compacted in place)."""

    __slots__ = ("data", "n", "start")

    def __init__(self) -> None:
        self.data: torch.Tensor | None = None
        self.n = 0
        self.start = 0

    def append(self, x: torch.Tensor) -> None:
        t = x.shape[2]
        if t == 0:
            return
        if self.data is None:
            shape = list(x.shape)
            shape[2] = max(t, 16)
            self.data, self.start = x.new_empty(shape), 0
        elif self.start + self.n + t > self.data.shape[2]:
            shape = list(self.data.shape)
            shape[2] = max(self.n + t, 2 * shape[2]) if self.start == 0 else max(16, 2 * (self.n + t))
            grown = self.data.new_empty(shape)
            grown[:, :, : self.n] = self.data[:, :, self.start : self.start + self.n]
            self.data, self.start = grown, 0
        end = self.start + self.n
        self.data[:, :, end : end + t] = x
        self.n += t

    def view(self) -> torch.Tensor | None:
        return None if self.data is None else self.data[:, :, self.start : self.start + self.n]

    def drop_front(self, t: int) -> None:
        if t <= 0:
            return
        t = min(t, self.n)
        self.start += t
        self.n -= t

    def alloc_bytes(self) -> int:
        """Bytes of the tensor allocated (its capacity, not just the rows in use)."""
        return 0 if self.data is None else self.data.numel() * self.data.element_size()

    def nbytes(self) -> int:
        if self.data is None:
            return 0
        per_unit = self.data[:, :, :1].numel() * self.data.element_size()
        return per_unit * self.n

    def select_batch(self, index: torch.Tensor) -> None:
        if self.data is not None:
            self.data = self.data.index_select(0, index.to(self.data.device))


def window_start(seen: int, window: int, align: int) -> int:
    """The first token a window-bounded store still holds after ``seen`` tokens."""
    return max(0, seen - window) // align * align


class KVStore:
    """The K or the V rows of one layer under one codec."""

    def __init__(self, codec: Codec, sink: int, recent: int, window: int | None = None, align: int = 1) -> None:
        self.codec = codec
        self.window = window
        self.align = align
        self.sink = 0 if (codec.lossless or window is not None) else sink
        self.recent = recent
        self.seen = 0  # tokens ever appended
        self.dropped = 0  # tokens evicted from the front (window-bounded stores)
        self.last_evicted = 0
        self.head = GrowBuffer()
        self.tail = GrowBuffer()
        self.packed: dict[str, GrowBuffer] = {}
        self.n_packed = 0
        self.state: dict[str, torch.Tensor] | None = None
        #: the most bytes of dense (unpacked) rows this store held at once: the caller's incoming rows + the
        #: sink and tail buffers' capacity (+ the old tail buffer while it grows), in the rows' own dtype
        self.peak_dense_bytes = 0

    # -- sizes --------------------------------------------------------------------------------
    @property
    def n_tokens(self) -> int:
        return self.head.n + self.n_packed + self.tail.n

    @property
    def n_full_precision(self) -> int:
        return self.head.n + self.tail.n

    # -- writes -------------------------------------------------------------------------------
    def append(self, x: torch.Tensor) -> list[tuple[int, dict[str, torch.Tensor]]]:
        """Add rows; returns ``(start_token, encoded)`` for each chunk packed by this call."""
        self.seen += x.shape[2]
        incoming = x.numel() * x.element_size()
        free = self.sink - self.head.n
        if free > 0:
            self.head.append(x[:, :, :free])
            x = x[:, :, free:]
        before = self.tail.alloc_bytes()
        self.tail.append(x)
        after = self.tail.alloc_bytes()
        held = incoming + self.head.alloc_bytes() + after + (before if after != before else 0)
        self.peak_dense_bytes = max(self.peak_dense_bytes, held)
        self.last_evicted = self._evict() if self.window is not None else 0
        return self._flush()

    def _evict(self) -> int:
        """Drop the rows that fell out of the window (packed units first, then tail rows); returns how many."""
        drop = window_start(self.seen, self.window, self.align) - self.dropped
        if drop <= 0:
            return 0
        self.dropped += drop
        packed = min(drop, self.n_packed)
        if packed:
            for buf in self.packed.values():
                buf.drop_front(buf.n * packed // self.n_packed)
            self.n_packed -= packed
        if self.n_packed == 0:
            self.packed = {}
            self.state = None  # recalibrated on the rows in the window when packing starts again
        self.tail.drop_front(drop - packed)
        return drop

    def _flush(self) -> list[tuple[int, dict[str, torch.Tensor]]]:
        if self.codec.lossless:
            return []
        tpu = self.codec.tokens_per_unit
        n = ((self.tail.n - self.recent) // tpu) * tpu
        if n <= 0:
            return []
        if self.state is None:
            # calibrate (key centering mean, outlier channels) on every full-precision row seen so far
            seen = [t for t in (self.head.view(), self.tail.view()) if t is not None and t.shape[2]]
            self.state = self.codec.calibrate(torch.cat(seen, dim=2))
        rows = self.tail.view()[:, :, :n]
        enc = self.codec.encode(rows, self.state)
        for name, t in enc.items():
            self.packed.setdefault(name, GrowBuffer()).append(t)
        start = self.head.n + self.n_packed
        self.n_packed += n
        self.tail.drop_front(n)
        return [(start, enc)]

    # -- reads --------------------------------------------------------------------------------
    def packed_view(self) -> dict[str, torch.Tensor]:
        return {name: buf.view() for name, buf in self.packed.items()}

    def decode_packed(self, dtype: torch.dtype) -> torch.Tensor | None:
        if not self.n_packed:
            return None
        return self.codec.decode(self.packed_view(), self.state, dtype)

    def dense(self, dtype: torch.dtype) -> torch.Tensor | None:
        """Everything the store holds as one dense tensor (dequantized where packed)."""
        parts = [self.head.view(), self.decode_packed(dtype), self.tail.view()]
        parts = [p if p.dtype == dtype else p.to(dtype) for p in parts if p is not None and p.shape[2]]
        if not parts:
            return None
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)

    # -- bytes --------------------------------------------------------------------------------
    def bytes_breakdown(self) -> dict[str, int]:
        """Exact bytes: full-precision rows (fp16 basis), packed tensors, per-layer codec state."""
        if self.codec.lossless:
            ref = self.tail.view()
            rows = 0 if ref is None else ref.shape[0] * ref.shape[1] * self.tail.n
            d = 0 if ref is None else ref.shape[3]
            return {"full_precision": rows * self.codec.unit_bytes(d) if rows else 0, "packed": 0, "state": 0}
        fp = 0
        for buf in (self.head, self.tail):
            if buf.data is not None:
                fp += buf.data[:, :, :1].numel() * FP_BYTES * buf.n
        packed = sum(buf.nbytes() for buf in self.packed.values())
        state = self.codec.state_bytes(self.state) if self.state else 0
        return {"full_precision": fp, "packed": packed, "state": state}

    def select_batch(self, index: torch.Tensor) -> None:
        for buf in (self.head, self.tail, *self.packed.values()):
            buf.select_batch(index)
        if self.state:
            self.state = {
                k: (t.index_select(0, index.to(t.device)) if t.dim() >= 1 and t.shape[0] > 1 else t)
                for k, t in self.state.items()
            }
