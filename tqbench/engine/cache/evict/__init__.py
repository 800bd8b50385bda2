"""Token eviction in a compressed layer (``policy.keep``): which rows each KV head keeps, chosen by a score.

- ``compact.py``: ``compact_store`` keeps given rows of a ``KVStore`` per KV head (codes gathered, never
  re-quantized; rows packed after the cut encoded from their exact values).
- ``scores.py``: the scores (SnapKV, key norm, expected attention, H2O, TOVA) from the call's queries.
- ``state.py``: ``Evictor``, one layer's eviction state (positions held, query window, accumulated mass,
  counts) and the eviction points.

How many rows a head keeps is ``policy.keep.kept_rows`` (the byte estimate's rule too).
"""
