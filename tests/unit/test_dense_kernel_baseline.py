"""The kernel-attended 16-bit dense baselines (``cache.dense_kernel``): the same 16-bit rows as ``dense-fp16``, read
as stored by the native kernel (one call per layer per step), outputs equal to the upcast baseline's to float32
rounding; the kernel's 16-bit row chunks read exactly; refusals that say why."""

import pytest
import torch

from tqbench.engine.cache.dense_kernel import KV_BLOCK_ROWS, DenseKernelCache, kernel_calls
from tqbench.kernels.cpu import native_status

pytestmark = pytest.mark.skipif(not native_status()[0], reason=f"native kernel unavailable: {native_status()[1]}")


def _decode(engine, name: str, ids: torch.Tensor, steps: int):
    """Logits of a prefill + ``steps - 1`` greedy decode steps (``[steps, vocab]``) and the cache."""
    cache = engine.make_cache(name)
    out, tok = [], ids
    with torch.inference_mode():
        for _ in range(steps):
            logits = engine.model(input_ids=tok, cache=cache).logits[0, -1]
            out.append(logits)
            tok = logits.argmax().view(1, 1)
    return torch.stack(out), cache


@pytest.mark.parametrize("name", ["dense-fp16", "dense-bf16"])
def test_kernel_baseline_matches_the_upcast_baseline(tiny_engine, name):
    ids = torch.randint(4, 200, (1, 40), generator=torch.Generator().manual_seed(1))
    ref, _ = _decode(tiny_engine, name, ids, 8)
    got, cache = _decode(tiny_engine, f"{name}-kernel", ids, 8)
    assert isinstance(cache, DenseKernelCache)
    assert torch.equal(ref.argmax(-1), got.argmax(-1))
    assert (ref - got).abs().max().item() < 2e-4 * ref.abs().max().item()  # float32 summation order only
    layers = tiny_engine.config.num_hidden_layers
    assert kernel_calls(cache) == layers * 7  # every decode step of every layer: one kernel call (prefill: exact)
    dtype = torch.float16 if name == "dense-fp16" else torch.bfloat16
    assert cache.layers[0].keys.dtype == dtype and cache.layers[0].keys.shape[2] == 47


def test_sliding_window_family_beyond_the_window():
    from tests.unit.families.short_windows import SHORT_WINDOW, short_window_model
    from tqbench.engine.engine import Engine

    eng = Engine(short_window_model("mistral"))
    ids = torch.randint(4, 200, (1, 3 * SHORT_WINDOW), generator=torch.Generator().manual_seed(3))
    ref, _ = _decode(eng, "dense-fp16", ids, 2 * SHORT_WINDOW)
    got, cache = _decode(eng, "dense-fp16-kernel", ids, 2 * SHORT_WINDOW)
    assert torch.equal(ref.argmax(-1), got.argmax(-1))
    assert (ref - got).abs().max().item() < 2e-4 * ref.abs().max().item()
    sliding = [la for la in cache.layers if la.is_sliding]
    assert sliding and all(la.keys.shape[2] == SHORT_WINDOW - 1 for la in sliding)  # the window, as DynamicCache
    assert kernel_calls(cache) == eng.config.num_hidden_layers * (2 * SHORT_WINDOW - 1)


def test_full_layers_append_in_place_in_blocks(tiny_engine):
    cache = tiny_engine.make_cache("dense-fp16-kernel")
    k = torch.randn(1, 2, KV_BLOCK_ROWS - 1, 16)
    cache.update(k, k, 0)
    layer = cache.layers[0]
    buf = layer._kbuf
    assert buf.shape[2] == KV_BLOCK_ROWS and layer.keys.data_ptr() == buf.data_ptr()
    row = torch.randn(1, 2, 1, 16)
    cache.update(row, row, 0)  # fills the block: same buffer, no copy
    assert layer._kbuf is buf and layer.keys.shape[2] == KV_BLOCK_ROWS
    cache.update(row, row, 0)  # one more row: a second block, the rows copied once
    assert layer._kbuf.shape[2] == 2 * KV_BLOCK_ROWS
    assert torch.equal(layer.keys, torch.cat([k, row, row], 2).half())
    assert layer.keys.nbytes == (KV_BLOCK_ROWS + 1) * 2 * 16 * 2  # what the rows hold (the block's spare rows apart)


def test_kernel_reads_16_bit_row_chunks_exactly_and_refuses_other_dtypes():
    from tqbench.kernels.cpu import native_module

    mod = native_module()
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 1, 64, generator=gen), torch.randn(1, 2, 70, 64, generator=gen),
               torch.randn(1, 2, 70, 64, generator=gen))

    def attend(query, kr, vr):
        return mod.attend(query, 0.125, [mod.Side(head_dim=64, dense=[kr[:, :, :30], kr[:, :, 30:]])],
                          [mod.Side(head_dim=64, dense=[vr])], [], 0.0, None, 0.0)[0]

    for dt in (torch.float16, torch.bfloat16):
        k16, v16 = k.to(dt), v.to(dt)
        assert torch.equal(attend(q, k16, v16), attend(q, k16.float(), v16.float()))  # read as its exact upcast
        assert torch.equal(attend(q.double(), k16, v16), attend(q.double(), k16.double(), v16.double()))
    with pytest.raises(RuntimeError, match=r"k_sides\[0\]\.dense\[0\] must be float32 \(the query's dtype\), "
                                           r"float16 or bfloat16 \(16-bit rows are read as stored\), got int8"):
        attend(q, k.to(torch.int8), v)
    with pytest.raises(RuntimeError, match=r"v_sides\[0\]\.dense\[0\] must be float32 .*got float64"):
        attend(q, k, v.double())


def test_refused_where_the_kernel_cannot_run(tiny_engine, monkeypatch):
    import tqbench.kernels.cpu as cpu

    monkeypatch.setattr(cpu, "native_status", lambda: (False, "no C++ compiler (c++ not found)"))
    with pytest.raises(RuntimeError, match="the dense-fp16-kernel baseline needs tqbench's native CPU kernel, which "
                                           r"cannot run here: no C\+\+ compiler \(c\+\+ not found\); use dense-fp16"):
        tiny_engine.make_cache("dense-fp16-kernel")
    from tqbench.engine.cache.dense_kernel import check_kernel_baseline

    with pytest.raises(RuntimeError, match="attends with tqbench's native CPU kernel, and this model is on cuda"):
        check_kernel_baseline("dense-bf16-kernel", "cuda")


def test_its_rows_outside_tqbench_attention_say_what_to_do(tiny_engine):
    from tqbench.engine.cache.dense_baseline import dense_cache

    cache = dense_cache(tiny_engine.config, "dense-fp16-kernel")  # not through Engine.make_cache: not wired
    k, _ = cache.update(torch.randn(1, 2, 3, 16), torch.randn(1, 2, 3, 16), 0)
    with pytest.raises(TypeError, match="kernel-attended dense baseline handed its 16-bit rows to matmul.*"
                                        "install_fused_attention"):
        torch.matmul(k, k)
    assert tiny_engine.baseline_kv_dtype("dense-fp16-kernel") == "float16"


def test_chunked_prefill_attends_each_chunk_through_the_kernel(tiny_engine):
    """Prefill chunks after the first have history: many query rows per kernel call, under the causal mask."""
    ids = torch.randint(4, 200, (1, 50), generator=torch.Generator().manual_seed(5))
    ref = tiny_engine.generate(ids, "dense-fp16", max_new_tokens=8, stop_at_eos=False, prefill_chunk=16)
    got = tiny_engine.generate(ids, "dense-fp16-kernel", max_new_tokens=8, stop_at_eos=False, prefill_chunk=16)
    assert got.token_ids == ref.token_ids and got.kv_policy == "dense-fp16-kernel"
