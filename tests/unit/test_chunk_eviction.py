"""``chunk=N`` (ChunkKV): rows are ranked by the mean score of their aligned chunk of N positions, so a layer keeps
or evicts whole chunks; the row count rule (and so the bytes) is the one without chunks."""

import pytest
import torch

from tqbench.engine.cache.estimate import estimate_kv
from tqbench.engine.cache.evict.scores import chunked
from tqbench.engine.cache.layer import TQLayer
from tqbench.engine.policy import parse_policy


def test_chunked_is_the_mean_of_each_chunk_of_held_positions():
    s = torch.tensor([[[1.0, 3.0, 5.0, 7.0, 2.0, float("-inf")]]])
    pos = torch.tensor([[[0, 1, 4, 5, 7, 2**31 - 1]]])  # positions 2, 3, 6 evicted earlier; the last one padding
    out = chunked(s, pos, 4)
    assert out[0, 0, :5].tolist() == pytest.approx([2.0, 2.0, 14 / 3, 14 / 3, 14 / 3])
    assert out[0, 0, 5] == float("-inf")  # padding stays out
    assert torch.equal(chunked(s, pos, 1), s)


def test_keynorm_with_chunks_keeps_whole_aligned_chunks():
    pol = parse_policy("fp16,sink=4,keep=0.5,score=keynorm,window=4,chunk=4")
    layer = TQLayer(pol.plan(1)[0], "compressed", pol, kv_heads=2)
    g = torch.Generator().manual_seed(0)
    norms = torch.rand(2, 28, generator=g) + 0.5
    norms[:, 8:12] = 0.1  # the chunk [8, 12) has the lowest norms (keynorm keeps low-norm keys)
    norms[:, 16:20] = 0.2
    k = torch.randn(1, 2, 28, 8, generator=g)
    k = k / k.norm(dim=-1, keepdim=True) * norms[None, :, :, None]
    layer.update(k, torch.randn(1, 2, 28, 8, generator=g))
    layer.after_attention(torch.randn(1, 4, 28, 8), 1.0, True)
    # 4 sinks + the last 4 + floor(0.5 * 20) = 10 of the 20 rows between: chunks [8,12) and [16,20) whole, then
    # two rows of the next best chunk
    for h in range(2):
        kept = layer.evictor.positions.view()[0, h].tolist()
        assert len(kept) == 18
        middle = [p for p in kept if 4 <= p < 24]
        assert set(range(8, 12)) | set(range(16, 20)) <= set(middle)
        rest = sorted(set(middle) - set(range(8, 12)) - set(range(16, 20)))
        assert len(rest) == 2 and rest[0] // 4 == rest[1] // 4  # the third chunk, cut at the budget


def test_chunk_costs_the_bytes_of_the_same_keep():
    from tqbench.engine.cache.geometry import KVGeometry

    g = KVGeometry(num_layers=2, kv_heads=2, head_dim=64)
    assert (estimate_kv("turbo4,keep=0.5,chunk=8", g, 4096).total_bytes
            == estimate_kv("turbo4,keep=0.5", g, 4096).total_bytes)


@pytest.mark.parametrize("text,msg", [
    ("turbo4,keep=0.5,chunk=0", "chunk=0 is invalid: use a whole number of tokens >= 1"),
])
def test_bad_chunk_says_what_to_use(text, msg):
    with pytest.raises(ValueError, match=msg):
        parse_policy(text)


def test_chunk_is_a_ranking_setting_like_score_and_window():
    """Without keep it changes nothing (as score= and window=), so allocate's --base can carry it for the keeps
    it chooses."""
    assert parse_policy("turbo4,chunk=8").evicts is False


def test_chunk_round_trips():
    pol = parse_policy("turbo4,keep=0.5,chunk=8")
    assert "chunk=8" in pol.to_string() and parse_policy(pol.to_string()) == pol
    assert parse_policy("turbo4,keep=0.5").chunk == 1


def test_allocate_keep_cells_rank_in_the_base_policys_chunks_as_the_cache_does(tiny_engine64):
    """``allocate --base chunk=4``: the keep cells keep the rows a real evicting cache with chunk=4 keeps."""
    from tqbench.engine.allocate.chunk import ChunkRunner
    from tqbench.engine.allocate.keeps import KeepCells, keep_key
    from tqbench.engine.cache import TQCache

    eng = tiny_engine64
    ids = torch.randint(3, 200, (1, 56), generator=torch.Generator().manual_seed(1))
    runner = ChunkRunner(eng, ids, 48)
    cells = KeepCells(runner, "snapkv", 4, chunk=4)
    idx = cells.index(1, 0.5, 2, 4)
    eng.enable_fused()
    cache = TQCache("fp16,sink=2,recent=4,window=4,keep@1=0.5,chunk=4", eng.model.config, mode="compressed")
    with torch.inference_mode():
        eng.model(ids[:, :48], cache=cache)
    assert cache.layers[1].evictor.positions.view().tolist() == idx.tolist()
    assert idx.tolist() != KeepCells(runner, "snapkv", 4).index(1, 0.5, 2, 4).tolist()  # chunks changed the choice
    assert keep_key(1, "snapkv", 4, 0.5, 4) == "1/keep/snapkv.w4.c4.0.5" and keep_key(1, "snapkv", 4, 0.5) == (
        "1/keep/snapkv.w4.0.5")


def test_a_ranking_change_reuses_the_codec_cells_of_a_partial_file():
    """The partial file's setup names the codec options without the eviction ranking (keep cells name it)."""
    from tqbench.engine.allocate.job import _codec_options

    assert _codec_options(parse_policy("k=fp16,v=fp16,chunk=8,score=tova,window=16")) == _codec_options(
        parse_policy("k=fp16,v=fp16")) == "k=fp16,v=fp16"
    assert _codec_options(parse_policy("k=fp16,v=fp16,rotation=hadamard")) != _codec_options(parse_policy("k=fp16,v=fp16"))
