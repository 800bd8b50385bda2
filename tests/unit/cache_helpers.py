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


def fused_as_reference(engine, policy, monkeypatch, impl: str = "triton"):
    """Generate 4 tokens of a fixed 40-token prompt in fused mode with ``TQBENCH_FUSED_IMPL=impl`` and check they
    are the torch reference's tokens; returns both runs' ``GenerationResult`` (reference, run: their cache reports
    say what ran)."""
    ids = torch.randint(5, 200, (1, 40), generator=torch.Generator().manual_seed(1))
    monkeypatch.setenv("TQBENCH_FUSED_IMPL", "torch")
    ref = engine.generate(ids, policy, "fused", max_new_tokens=4, stop_at_eos=False)
    monkeypatch.setenv("TQBENCH_FUSED_IMPL", impl)
    got = engine.generate(ids, policy, "fused", max_new_tokens=4, stop_at_eos=False)
    assert got.token_ids == ref.token_ids
    return ref, got


def runs_in_every_mode(engine, ids, policy, max_new_tokens: int = 8) -> dict:
    """``policy`` generated in simulate, compressed and fused: the same tokens in all three, the fused calls all in
    the native kernel; the runs by mode."""
    runs = {m: engine.generate(ids, policy, m, max_new_tokens=max_new_tokens, stop_at_eos=False)
            for m in ("simulate", "compressed", "fused")}
    assert runs["fused"].token_ids == runs["compressed"].token_ids == runs["simulate"].token_ids
    rep = runs["fused"].cache_report
    assert rep.fused_impl == {"native-cpu": rep.fused_calls} and rep.fused_calls > 0
    return runs
