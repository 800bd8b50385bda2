"""Chunked prefill into the compressed store: a long prompt never holds its whole dense K/V (the store's own peak
accounting says so), the ``auto`` rule, and the ``--prefill-chunk`` option's errors."""

from __future__ import annotations

import pytest
import torch

from tqbench.constants import (
    PREFILL_CHUNK_ABOVE,
    PREFILL_CHUNK_TOKENS,
    auto_prefill_chunk,
    parse_prefill_chunk,
)
from tqbench.engine.cache.tqcache import TQLayer
from tqbench.engine.engine import Engine

PROMPT = 16384


@pytest.fixture(scope="module")
def engine():
    return Engine.tiny()


def _prefill(engine, ids, chunk):
    seq = engine.sequence(ids, "turbo4", "fused", max_new_tokens=1, prefill_chunk=chunk)
    seq.start()
    return seq


def test_16k_prompt_prefilled_in_chunks_never_holds_its_dense_kv(engine):
    ids = torch.randint(4, 260, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    geo = engine.geometry
    row = geo.kv_heads * geo.head_dim * 4  # bytes of one fp32 K (or V) row, all KV heads
    whole_prompt_kv = 2 * geo.num_layers * PROMPT * row

    seq = _prefill(engine, ids, None)  # auto: 16K tokens > PREFILL_CHUNK_ABOVE -> chunks
    assert seq.prefill_chunk == PREFILL_CHUNK_TOKENS
    cache = seq.cache
    layers = [la for la in cache.layers if isinstance(la, TQLayer)]
    assert len(layers) == geo.num_layers
    for la in layers:
        assert la.k_store.n_tokens == la.v_store.n_tokens == PROMPT
        # each chunk after the first attended over the packed history through the native kernel
        assert la.fused_impl == {"native-cpu": PROMPT // PREFILL_CHUNK_TOKENS - 1} and not la.fallbacks
        for store in (la.k_store, la.v_store):
            assert store.n_packed >= PROMPT - store.recent - store.sink - store.codec.tokens_per_unit
            # at most: the incoming chunk + the sink buffer + the tail buffer (which doubles past chunk + recent)
            # + its previous allocation while it grows
            bound = (PREFILL_CHUNK_TOKENS + 16 + 4 * (PREFILL_CHUNK_TOKENS + store.recent)) * row
            assert 0 < store.peak_dense_bytes <= bound < PROMPT * row
    assert cache.peak_dense_kv_bytes() <= whole_prompt_kv * 5 * (PREFILL_CHUNK_TOKENS + 64) // PROMPT
    assert cache.peak_dense_kv_bytes() < whole_prompt_kv // 2

    # the same accounting sees the whole prompt's dense K/V when it is prefilled in one call
    whole = _prefill(engine, ids, 0).cache
    assert whole.peak_dense_kv_bytes() >= whole_prompt_kv
    for la in whole.layers:
        assert la.k_store.peak_dense_bytes >= PROMPT * row and la.fused_impl == {}


def test_chunked_prefill_tokens_match_one_call_prefill_closely(engine):
    """Chunked prefill reads earlier chunks as stored (quantized), so logits differ a little from one exact call."""
    ids = torch.randint(4, 260, (1, 600), generator=torch.Generator().manual_seed(1))
    one = _prefill(engine, ids, 0)
    chunked = _prefill(engine, ids, 128)
    assert chunked.prefill_chunk == 128 and sum(la.fused_calls for la in chunked.cache.layers) == 4 * 4
    p, q = torch.log_softmax(one.logits.float(), -1), torch.log_softmax(chunked.logits.float(), -1)
    kl = float((p.exp() * (p - q)).sum())
    assert 0 < kl < 0.05
    assert int(one.logits.argmax()) == int(chunked.logits.argmax())


def test_auto_rule_and_bad_values():
    assert auto_prefill_chunk(PREFILL_CHUNK_ABOVE, "fused") == 0
    assert auto_prefill_chunk(PREFILL_CHUNK_ABOVE + 1, "fused") == PREFILL_CHUNK_TOKENS
    assert auto_prefill_chunk(PREFILL_CHUNK_ABOVE + 1, "compressed") == PREFILL_CHUNK_TOKENS
    for mode in ("dynamic", "simulate", "dense-shadow"):  # these keep a dense copy anyway
        assert auto_prefill_chunk(10 * PREFILL_CHUNK_ABOVE, mode) == 0
    assert auto_prefill_chunk(10 * PREFILL_CHUNK_ABOVE, "fused", 0) == 0
    assert auto_prefill_chunk(100, "simulate", 32) == 32
    assert parse_prefill_chunk("auto") is None and parse_prefill_chunk("0") == 0 and parse_prefill_chunk("512") == 512
    for bad in ("-1", "lots", "1.5"):
        with pytest.raises(ValueError, match=f"--prefill-chunk '{bad}' is invalid: use auto, 0"):
            parse_prefill_chunk(bad)


def test_cli_rejects_a_bad_prefill_chunk():
    from click.testing import CliRunner

    from tqbench.cli import main

    res = CliRunner().invoke(main, ["--headless", "bench", "--model", "tiny", "--prefill-chunk", "-5"])
    assert res.exit_code == 2
    assert "invalid value for --prefill-chunk: use auto, 0 (the whole prompt in one forward call)" in res.output
