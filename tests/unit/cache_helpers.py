"""Shared test steps for caches: feed tokens the way generation does, and check a cache's bytes against the
config-only estimate to the byte (the one rule every codec family's byte test uses)."""

from __future__ import annotations

import torch

from tqbench.engine.cache.estimate import KVGeometry, estimate_kv


def prefill_then_steps(model, cache, tokens: int, steps: int = 3) -> None:
    """Random ids: a prefill of ``tokens - steps`` (at least 1), then single-token calls up to ``tokens``."""
    ids = torch.randint(3, 200, (1, tokens))
    first = max(tokens - steps, 1)
    with torch.inference_mode():
        model(ids[:, :first], cache=cache)
        for t in range(first, tokens):
            model(ids[:, t : t + 1], cache=cache)


def assert_report_matches_estimate(model, cache, policy, tokens: int) -> None:
    """Run ``tokens`` through ``cache`` and check its report against ``estimate_kv``: total, per layer, shared."""
    prefill_then_steps(model, cache, tokens)
    rep = cache.report()
    est = estimate_kv(policy, KVGeometry.from_config(model.config), tokens)
    assert rep.compressed_storage_bytes == est.total_bytes
    assert [r.total_bytes for r in rep.layers] == est.layer_bytes
    assert rep.shared_bytes == est.shared_bytes
    assert rep.dense_fp16_bytes == est.dense_fp16_bytes
    assert sum(r.total_bytes for r in rep.layers) + rep.shared_bytes == rep.compressed_storage_bytes


def store_bytes_snapshot(store) -> dict:
    """Everything a ``KVStore`` holds, as bytes (so equal means byte for byte), plus its counts."""
    out = {"counts": (store.seen, store.dropped, store.n_packed, store.head.n, store.tail.n)}
    for name, t in (("head", store.head.view()), ("tail", store.tail.view()),
                    *((f"packed.{k}", v) for k, v in store.packed_view().items()),
                    *((f"state.{k}", v) for k, v in (store.state or {}).items())):
        if t is not None:
            out[name] = t.contiguous().view(torch.uint8).flatten().tolist()
    return out
