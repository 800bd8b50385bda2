"""The decode step's append path: a store's new rows quantized + packed by one native call straight into its packed
buffers (``HeadsEncoder.encode_into``, ``KVStore._encode_in_place``).

The packed bytes equal the torch codec path's (float64: every byte; float32: every byte of the native ``encode``,
which runs the same row arithmetic, and > 99.9% of the torch path's codes, whose matmul sums in another order), for
turbo keys (centred) and values, calibrated keys and per-head layers; 16-bit rows as the codecs compute them (float32).
Where the path cannot run, the cache report says why.
"""

from __future__ import annotations

import pytest
import torch

from tqbench.engine.cache.store import APPEND_IN_PLACE, KVStore
from tqbench.engine.codecs import HeadSplitCodec, codec_from_spec
from tqbench.engine.policy import parse_policy
from tqbench.kernels.cpu import native_status

pytestmark = pytest.mark.skipif(not native_status()[0], reason=native_status()[1])


def _rows(b, h, t, d=64, seed=0, dtype=torch.float64):
    return (torch.randn(b, h, t, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 3
            + 0.5).to(dtype)


def _torch_only(codec, monkeypatch) -> None:
    """Make ``codec.encode`` run its torch path (no native call anywhere inside it)."""
    subs = codec.subs if isinstance(codec, HeadSplitCodec) else [codec]
    if isinstance(codec, HeadSplitCodec):
        monkeypatch.setattr(codec, "_native_plan", lambda *a: None)
    for c in subs:
        for name in ("_native_quantize_pack", "_native_encode"):
            if hasattr(c, name):
                monkeypatch.setattr(c, name, lambda *a: None)


def _store_packed(codec, x: torch.Tensor, prefill: int) -> tuple[KVStore, dict]:
    """A store fed ``prefill`` rows at once, then the rest one row per call (the decode steps); its packed fields."""
    store = KVStore(codec, sink=0, recent=0)
    store.append(x[:, :, :prefill])
    for t in range(prefill, x.shape[2]):
        store.append(x[:, :, t : t + 1])
    return store, store.packed_view()


CODECS = [("turbo4", "k"), ("turbo3", "v"), ("turbo2", "k"), ("turbo1", "v"), ("turbo4|turbo2|turbo4", "k"),
          ("turbo2|turbo3|turbo4", "v")]


@pytest.mark.parametrize("spec,role", CODECS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_rows_packed_in_place_are_the_codecs_own_codes(spec, role, dtype, monkeypatch):
    pol = parse_policy(f"{role}={spec}")
    codec = pol.layer_codecs(pol.plan(1)[0], 3)[0 if role == "k" else 1]
    x = _rows(2, 3, 40, dtype=dtype)
    store, got = _store_packed(codec, x, prefill=24)
    assert store.append_path == APPEND_IN_PLACE and store.n_packed == 40
    native = codec.encode(x, store.state)  # the codec's own encode (native where it has one) of every row at once
    assert got.keys() == native.keys()
    for name in got:
        assert torch.equal(got[name], native[name]), name
    _torch_only(codec, monkeypatch)
    ref = codec.encode(x, store.state)
    for name in got:
        if dtype == torch.float64:
            assert torch.equal(got[name], ref[name]), name
        else:  # the torch path's matmul sums in another order: a code near a midpoint may flip
            same = (got[name] == ref[name]).double().mean().item()
            assert same > 0.999 if "idx" in name else torch.allclose(got[name].double(), ref[name].double(),
                                                                      rtol=2e-3), (name, same)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_rows_are_packed_as_the_codec_computes_them(dtype):
    codec = codec_from_spec("turbo4", role="k", center=True)
    x = _rows(1, 3, 30, dtype=dtype)
    store, got = _store_packed(codec, x, prefill=10)
    assert store.append_path == APPEND_IN_PLACE
    want = codec.encode(x, store.state)  # (float32 compute: the rows widened exactly, then centred)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_calibrated_keys_are_packed_in_place(tiny_engine, tmp_path, monkeypatch):
    from tqbench.engine.calibrate import fit_transforms
    from tqbench.engine.codecs.transforms_file import save_transforms

    path = save_transforms(fit_transforms(tiny_engine, ["prose"], max_tokens=64), tmp_path / "t.safetensors")
    codec = codec_from_spec("pcaq3", "k", layer=1, calib=str(path))
    heads, d = tiny_engine.model.config.num_key_value_heads, tiny_engine.model.config.head_dim
    x = _rows(1, heads, 20, d=d)
    store, got = _store_packed(codec, x, prefill=8)
    assert store.append_path == APPEND_IN_PLACE
    _torch_only(codec, monkeypatch)
    assert torch.equal(got["idx"], codec.encode(x, store.state)["idx"])


def test_encode_into_checks_its_buffers_by_name():
    codec = codec_from_spec("turbo4", role="k", center=True)
    x = _rows(1, 3, 20, dtype=torch.float32)
    store, _ = _store_packed(codec, x, prefill=12)
    (names, encoder) = store._appender[2]
    codes, norms = (store.packed[n].data for n in names[0])
    src = store.tail.data
    with pytest.raises(RuntimeError, match=r"dsts\[1\].*Half"):
        encoder.encode_into(src, 0, 1, [codes, norms.float()], [0, 0])
    with pytest.raises(RuntimeError, match=r"offsets\[0\] = .*do not fit"):
        encoder.encode_into(src, 0, 1, [codes, norms], [codes.shape[2], 0])
    with pytest.raises(RuntimeError, match="one entry per packed field"):
        encoder.encode_into(src, 0, 1, [codes], [0])
    with pytest.raises(RuntimeError, match="outside src"):
        encoder.encode_into(src, src.shape[2], 1, [codes, norms], [0, 0])


def test_the_report_says_when_rows_are_not_packed_in_place(tiny_engine, monkeypatch):
    ids = tiny_engine.encode_prompt("The river bends twice before the sea, and the town grows along it.", chat=False)
    rep = tiny_engine.generate(ids, "turbo4,recent=2", "fused", max_new_tokens=3).cache_report
    assert not any("not in place" in n for n in rep.notes)
    import tqbench.engine.codecs.appender as appender

    def unavailable(codec):
        codec.encoder_fallback = "quantize-and-pack ran in torch (the native CPU kernel is unavailable: test)"

    monkeypatch.setattr(appender, "native_encoder", unavailable)
    rep = tiny_engine.generate(ids, "turbo4,recent=2", "fused", max_new_tokens=3).cache_report
    assert ("turbo4: new rows packed through the codec's encode, not in place (quantize-and-pack ran in torch (the "
            "native CPU kernel is unavailable: test))") in rep.notes
