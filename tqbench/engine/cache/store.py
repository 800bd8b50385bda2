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

**Points.** The store evicts and packs at *points*: by default once per ``append`` (a forward call's rows
together: a prefill attends exactly over its own rows and is packed afterwards). ``append_points`` takes
the points explicitly: speculative decoding verifies draft tokens in one call but gives each draft token
its own point, so the store ends exactly as if the tokens had been decoded one at a time (the same rows
packed, by the same encode calls, calibrated on the same rows).

**Crop.** ``mark()`` remembers the store as it is (buffer ends, counts, state) and the rows appended after
it; ``crop(n)`` back to any count at or after the mark restores the mark and replays the surviving rows
with their points, so the store is byte for byte the store that never saw the cropped rows: packed units
the cropped rows had completed are gone and their survivors are back in the full-precision tail, exact
(nothing is re-quantized from quantized values). Without a mark that reaches back far enough, only rows
still exact in the tail can be cropped, and only when the store at ``n`` would hold the same packed units;
anything else raises (the exact values are gone).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from tqbench.engine.cache.buffer import GrowBuffer
from tqbench.engine.cache.geometry import FP_BYTES, fp16_row_bytes
from tqbench.engine.codecs.base import Codec

__all__ = ["APPEND_IN_PLACE", "FP_BYTES", "GrowBuffer", "KVStore", "window_start"]

#: ``KVStore.append_path`` when new rows are packed by one native call straight into the packed buffers
APPEND_IN_PLACE = "native-in-place"

_STATE_VERSIONS = itertools.count(1)  # a calibration's identity (``id()`` of a freed dict can come back)


def window_start(seen: int, window: int, align: int) -> int:
    """The first token a window-bounded store still holds after ``seen`` tokens."""
    return max(0, seen - window) // align * align


@dataclass
class _Mark:
    seen: int
    dropped: int
    n_packed: int
    state: dict | None
    state_version: int
    calibrated_at: int
    head: tuple
    tail: tuple
    packed: dict
    rows: list = field(default_factory=list)  # (rows, points) appended since the mark


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
        self.evicted = 0  # rows each KV head dropped by token eviction (``cache.evict``)
        #: token eviction: pack nothing until ``release`` (the call's rows are scored, and cut, exact first)
        self.defer = False
        self.last_evicted = 0
        self.head = GrowBuffer()
        self.tail = GrowBuffer()
        self.packed: dict[str, GrowBuffer] = {}
        self.n_packed = 0
        self.state: dict[str, torch.Tensor] | None = None
        self.state_version = 0  # changes whenever ``state`` does (kernels cache per-state descriptions)
        self.calibrated_at = 0  # token count at which ``state`` was calibrated
        self._mark: _Mark | None = None
        #: the most bytes of dense (unpacked) rows this store held at once: the caller's incoming rows + the
        #: sink and tail buffers' capacity (+ the old tail buffer while it grows), in the rows' own dtype
        self.peak_dense_bytes = 0
        #: (state version, tail buffer, the native encoder of this state or why none): ``_encode_in_place``
        self._appender: tuple | None = None
        #: how new rows were last packed: "native-in-place", None (not yet, or a codec without a native encode),
        #: or why the native path could not run (the cache report says it)
        self.append_path: str | None = None

    def __getstate__(self) -> dict:
        """Copies (``copy.deepcopy``: a compressed context forked per question) and pickles leave out the native
        encoder, which is not copyable and is rebuilt on the copy's first append."""
        state = self.__dict__.copy()
        state["_appender"] = None
        return state

    # -- sizes and positions ----------------------------------------------------------------------
    @property
    def n_tokens(self) -> int:
        return self.head.n + self.n_packed + self.tail.n

    @property
    def n_full_precision(self) -> int:
        return self.head.n + self.tail.n

    @property
    def tail_start(self) -> int:
        """The absolute position of the first tail row: rows from ``sink`` up to here are packed (or evicted)."""
        return self.dropped + self.evicted + self.head.n + self.n_packed

    def tail_start_at(self, seen: int) -> int:
        """``tail_start`` of this store's policy after ``seen`` tokens (a pure function of the count)."""
        tpu = self.codec.tokens_per_unit
        if self.codec.lossless:
            return window_start(seen, self.window, self.align) if self.window is not None else 0
        if self.window is not None:
            return max(window_start(seen, self.window, self.align), max(0, seen - self.recent) // tpu * tpu)
        if seen <= self.sink:
            return seen
        return self.sink + max(0, (seen - self.sink - self.recent) // tpu * tpu)

    # -- writes -------------------------------------------------------------------------------
    def append(self, x: torch.Tensor) -> list[tuple[int, dict[str, torch.Tensor]]]:
        """Add rows (one point: this call's rows together); returns ``(position, encoded)`` for each chunk
        packed by this call, ``position`` the absolute token position of its first row."""
        return self.append_points(x)[0]

    def append_points(self, x: torch.Tensor, points: list[int] | None = None,
                      chunks: bool = True) -> tuple[list, list[int]]:
        """Add rows, evicting and packing at ``points`` (increasing row counts within ``x``, the last one
        ``x.shape[2]``; None: one point at the end). Returns (the chunks packed, as ``append``, or ``[]`` when
        ``chunks`` is False: the caller does not read them; ``tail_start`` after each point)."""
        t = x.shape[2]
        if t == 0 and not points:
            return [], [self.tail_start]
        points = [t] if points is None else points
        if not points or points[-1] != t or any(b <= a for a, b in zip([0, *points], points)):
            raise ValueError(f"points {points} must increase and end at the {t} rows appended")
        if self._mark is not None:
            self._mark.rows.append((x, points))
        incoming = x.numel() * x.element_size()
        out, cuts, evicted, prev = [], [], 0, 0
        for p in points:
            self._add(x if p == t and prev == 0 else x[:, :, prev:p], incoming)
            prev = p
            evicted += self._evict() if self.window is not None else 0
            if not self.defer:
                out += self._flush(chunks)
            cuts.append(self.tail_start)
        self.last_evicted = evicted
        return out, cuts

    def _add(self, x: torch.Tensor, incoming: int) -> None:
        self.seen += x.shape[2]
        free = self.sink - self.head.n
        if free > 0:
            self.head.append(x[:, :, :free])
            x = x[:, :, free:]
        before = self.tail.alloc_bytes()
        self.tail.append(x)
        self.note_dense_bytes(incoming, before)

    def note_dense_bytes(self, incoming: int, tail_before: int) -> None:
        """``peak_dense_bytes``'s one rule, after rows went to the tail: the caller's incoming rows + the sink and tail
        buffers' capacity + the old tail buffer (``tail_before`` bytes) while it grew."""
        after = self.tail.alloc_bytes()
        held = incoming + self.head.alloc_bytes() + after + (tail_before if after != tail_before else 0)
        self.peak_dense_bytes = max(self.peak_dense_bytes, held)

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
        if self.n_packed == 0 and self.state is not None:
            self.packed = {}
            self._set_state(None)  # recalibrated on the rows in the window when packing starts again
        self.tail.drop_front(drop - packed)
        return drop

    def release(self) -> list[tuple[int, dict[str, torch.Tensor]]]:
        """End a deferral (``defer``): pack what the policy packs now; the chunks, as ``append`` returns them."""
        self.defer = False
        return self._flush()

    def _set_state(self, state: dict | None) -> None:
        self.state = state
        self.state_version = next(_STATE_VERSIONS)
        self.calibrated_at = self.seen

    def _flush(self, chunks: bool = True) -> list[tuple[int, dict[str, torch.Tensor]]]:
        if self.codec.lossless:
            return []
        tpu = self.codec.tokens_per_unit
        n = ((self.tail.n - self.recent) // tpu) * tpu
        if n <= 0:
            return []
        if self.state is None:
            # calibrate (key centering mean, outlier channels) on every full-precision row seen so far
            seen = [t for t in (self.head.view(), self.tail.view()) if t is not None and t.shape[2]]
            self._set_state(self.codec.calibrate(torch.cat(seen, dim=2)))
        start = self.tail_start
        placed = self._encode_in_place(n)
        if placed is None:
            enc = self.codec.encode(self.tail.view()[:, :, :n], self.state)
            for name, t in enc.items():
                self.packed.setdefault(name, GrowBuffer()).append(t)
        self.n_packed += n
        self.tail.drop_front(n)
        if not chunks:
            return []
        if placed is not None:
            enc = {name: buf.data[:, :, at : at + n] for name, buf, at in placed}
        return [(start, enc)]

    def _encoder(self):
        """``(field names, HeadsEncoder)`` of this store's state and row buffer, or ``str``: why none (``append_path``)."""
        data = self.tail.data
        hit = self._appender  # (kept while the state and the row buffer stand: its dtype, batch, heads, head_dim)
        if hit is None or hit[0] != self.state_version or hit[1] is not data:
            if data.device.type != "cpu":
                return "rows on " + data.device.type
            from tqbench.engine.codecs.appender import heads_encoder, native_append_codec

            made = heads_encoder(self.codec, self.state, data.dtype, data.shape[3], data.shape[0], data.shape[1])
            if isinstance(made, str):
                self.append_path = (f"{self.codec.spec}: new rows packed through the codec's encode, not in place "
                                    f"({made})") if native_append_codec(self.codec) else None
            else:
                self.append_path = APPEND_IN_PLACE
            hit = self._appender = (self.state_version, data, made)
        return hit[2]

    def _encode_in_place(self, n: int) -> list | None:
        """The decode step's append path: the tail's first ``n`` rows quantized + packed by one native call straight
        into the packed buffers (``codecs.appender``); ``(name, buffer, offset)`` per field, or None when the codec's
        ``encode`` must run instead (no packed buffers yet, or no native encoder: ``append_path`` says why)."""
        made = self._encoder()
        if isinstance(made, str):
            return None
        names, encoder = made
        bufs = [(name, self.packed.get(name)) for group in names for name in group]
        if any(buf is None for _, buf in bufs):  # the first packed rows make the buffers (their shapes, dtypes)
            return None
        placed = [(name, buf, buf.reserve(n)) for name, buf in bufs]
        encoder.encode_into(self.tail.data, self.tail.start, n, [buf.data for _, buf, _ in placed],
                            [at for *_, at in placed])
        return placed

    def _step_plan(self, x: torch.Tensor):
        """``step.append_step``'s plan for this store and rows ``x``, or None where the general path must run: a decode
        step's rows (at least one) go to the tail (the sinks are full, no window, no mark, no deferral) and the rows to pack are
        packed by the store's native encoder into packed buffers that exist."""
        tail = self.tail
        data = tail.data
        if (self._mark is not None or self.defer or self.window is not None or self.state is None or data is None
                or self.head.n != self.sink or x.dtype != data.dtype or x.shape[0] != data.shape[0]
                or x.shape[1] != data.shape[1] or x.shape[3] != data.shape[3] or x.device.type != "cpu"
                or not x.shape[2]):
            return None
        hit = self._appender
        if hit is None or hit[0] != self.state_version or hit[1] is not data or isinstance(hit[2], str):
            return None
        names, encoder = hit[2]
        bufs = []
        for group in names:
            for name in group:
                buf = self.packed.get(name)
                if buf is None:
                    return None
                bufs.append(buf)
        return encoder, bufs

    # -- rollback -----------------------------------------------------------------------------
    def mark(self) -> None:
        """Remember the store as it is now: ``crop`` can come back to here (or to any later count) exactly."""
        self._mark = _Mark(self.seen, self.dropped, self.n_packed, self.state, self.state_version,
                           self.calibrated_at, self.head.state(), self.tail.state(),
                           {k: (buf, buf.state()) for k, buf in self.packed.items()})

    def unmark(self) -> None:
        self._mark = None

    def crop(self, n: int) -> list[tuple[int, dict[str, torch.Tensor]]] | None:
        """Keep the first ``n`` tokens ever appended, exactly as if the rest had never been. Returns the chunks
        packed since the mark (``append``'s form) when it went back to the mark, None when it only dropped
        tail rows. Raises when that cannot be done exactly."""
        if n < 0:
            raise ValueError(f"cannot crop to {n} tokens")
        if n >= self.seen:
            return None
        m = self._mark
        if m is not None and n >= m.seen:
            self.seen, self.dropped, self.n_packed = m.seen, m.dropped, m.n_packed
            self.state, self.state_version, self.calibrated_at = m.state, m.state_version, m.calibrated_at
            self.head.restore(m.head)
            self.tail.restore(m.tail)
            self.packed = {}
            for name, (buf, st) in m.packed.items():
                buf.restore(st)
                self.packed[name] = buf
            self._mark = None
            chunks = []
            # replay in the grad mode the rows were made in (buffers made under inference mode stay writable)
            with torch.inference_mode(any(x.is_inference() for x, _ in m.rows)):
                for x, points in m.rows:
                    keep = n - self.seen
                    if keep <= 0:
                        break
                    if keep < x.shape[2]:
                        x, points = x[:, :, :keep], [p for p in points if p < keep] + [keep]
                    chunks += self.append_points(x, points)[0]
            return chunks
        # no mark that far back: rows can go only while they are still exact in the tail and the store at ``n``
        # holds the same packed units (and a state calibrated on rows it still has)
        gone = self.seen - n
        same = (self.tail_start_at(n) == self.tail_start and gone <= self.tail.n
                and (not self.state or self.calibrated_at <= n)
                and (self.window is None or window_start(n, self.window, self.align) == self.dropped))
        if not same:
            raise ValueError(
                f"cannot crop this {self.codec.spec} store back to {n} tokens exactly: of the {gone} tokens to drop, "
                f"some were already packed (or evicted, or calibrated on) and their exact values are gone. Crop "
                "right after the forward call that appended them, with past recording on "
                "(cache.activate_past_recording(), as transformers' assisted decoding does)")
        self.tail.drop_back(gone)
        self.seen = n
        self._mark = None
        return None

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
                fp += fp16_row_bytes(buf.data.shape[0] * buf.data.shape[1] * buf.n, buf.data.shape[3])
        packed = self.codec.packed_nbytes(self.packed)
        state = self.codec.state_bytes(self.state) if self.state else 0
        return {"full_precision": fp, "packed": packed, "state": state}

    # -- batch ----------------------------------------------------------------------------------
    def select_batch(self, index: torch.Tensor) -> None:
        self._mark = None
        for buf in (self.head, self.tail, *self.packed.values()):
            buf.select_batch(index)
        if self.state:
            self.state = {
                k: (t.index_select(0, index.to(t.device)) if t.dim() >= 1 and t.shape[0] > 1 else t)
                for k, t in self.state.items()
            }
            self.state_version = next(_STATE_VERSIONS)

    def repeat_batch(self, repeats: int) -> None:
        """Each sequence ``repeats`` times, in place (``[a, b] -> [a, a, b, b]``)."""
        self._mark = None
        for buf in (self.head, self.tail, *self.packed.values()):
            buf.repeat_batch(repeats)
        if self.state:
            self.state = {k: (t.repeat_interleave(repeats, 0) if t.dim() >= 1 and t.shape[0] > 1 else t)
                          for k, t in self.state.items()}
            self.state_version = next(_STATE_VERSIONS)
