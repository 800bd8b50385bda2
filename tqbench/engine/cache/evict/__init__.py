"""Token eviction in a compressed layer (``policy.keep``): which rows each KV head keeps, chosen by a score.

- ``compact.py``: ``compact_store`` keeps given rows of a ``KVStore`` per KV head (codes gathered, never
  re-quantized; rows packed after the cut encoded from their exact values).
- ``scores/``: the scores, one class per module in a registry (SnapKV, key norm, expected attention, H2O, TOVA,
  KVzip), a ``score()`` hook each, and the ``Chunked`` wrapper (``chunk=N``); the Evictor, the allocator's keep
  cells and the byte estimate build them by name.
- ``reconstruct.py``: KVzip's context-reconstruction pass (the scores ``score=kvzip`` reads).
- ``budgets.py``: the head budgets over any score (uniform, AdaKV, a per-head keep list, ``budget=global``), one
  class each, and ``select_kept``; ``global_budget.py``: the cache-wide choice ``budget=global`` reads.
- ``demote.py``: ``DemoteTier``, the evicted rows at a cheaper codec, whatever the score and the budget.
- ``state.py``: ``Evictor``, one layer's eviction state (positions held, query window, accumulated mass,
  counts) and the eviction points.
- ``ragged.py``: a ragged layer (``heads=ada``, or a per-head keep list ``keep=0.5|1|0.25``): one store per KV
  head at that head's own codec, each its own rows (and its own demote store).

How many rows a head keeps is ``policy.keep.kept_rows`` (per head with a per-head keep list; the byte
estimate's rule too).
"""
