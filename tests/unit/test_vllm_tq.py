"""vLLM's TurboQuant KV presets as codecs, byte for byte.

The oracle is vLLM 0.33.0's rule written out here element by element, as its kernels run it (not the codec's
torch code): ``v1/attention/ops/triton_turboquant_store.py`` (``_tq_fused_store_mse``: binary-search bucketize,
index packing, fp16 norm; ``_store_quantized_value``: min/max uniform values, fp16 scale and zero) and
``triton_turboquant_decode.py`` (``_tq_full_dequant_kv``: centroid gather, norm correction, ``v = q * scale +
zero``). The codebooks are the output of vLLM's own ``centroids.get_centroids(d, bits)`` (pure Python, run on CPU
with vLLM 0.33.0's ``model_executor/layers/quantization/turboquant/centroids.py``), frozen below as fp32 hex.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tqbench.engine.codecs import codec_from_spec
from tqbench.engine.codecs.engine_formats import engine_setting
from tqbench.engine.codecs.vllm_tq import VLLM_TQ_PRESETS, hadamard, lloyd_max
from tqbench.engine.policy import parse_policy

#: vLLM 0.33.0 get_centroids(d, bits), fp32 (positive half; the codebooks are symmetric)
VLLM_CENTROIDS = {
    (64, 3): ("0x1.f5b9f6p-6", "0x1.82e3f8p-4", "0x1.57daa6p-3", "0x1.133ea8p-2"),
    (128, 4): ("0x1.73f75cp-7", "0x1.190ab2p-5", "0x1.dba1c2p-5", "0x1.5533e4p-4", "0x1.c6d056p-4",
               "0x1.24de2ep-3", "0x1.766dcep-3", "0x1.ee5988p-3"),
    (256, 3): ("0x1.f5b9f6p-7", "0x1.82e3f8p-5", "0x1.57daa6p-4", "0x1.133ea8p-3"),
    (256, 4): ("0x1.0705140p-7", "0x1.8d73fep-6", "0x1.505290p-5", "0x1.e28894p-5", "0x1.419a18p-4",
               "0x1.9e2d80p-4", "0x1.08c2e0p-3", "0x1.5d8edcp-3"),
}


def _codebook(d: int, bits: int) -> np.ndarray:
    half = [float.fromhex(h) for h in VLLM_CENTROIDS[(d, bits)]]
    return np.array([-h for h in reversed(half)] + half, dtype=np.float32)


def vllm_store_key(k: np.ndarray, bits: int) -> bytes:
    """One key row (fp32 [D]) as _tq_fused_store_mse stores it, written out scalar by scalar."""
    d = k.shape[0]
    c = _codebook(d, bits)
    mids = ((c[:-1] + c[1:]) / np.float32(2)).astype(np.float32)
    norm = np.float32(np.linalg.norm(k.astype(np.float32)))
    y = (k / (norm + np.float32(1e-8))).astype(np.float32) @ hadamard(d).numpy()
    idx = []
    for v in y:  # the kernel's binary search over the sorted midpoints, MSE_BITS iterations
        lo, hi = 0, len(c) - 1
        for _ in range(bits):
            mid = (lo + hi) >> 1
            m = mids[min(mid, len(c) - 2)]
            lo, hi = (mid + 1, hi) if v >= m else (lo, mid)
        idx.append(min(lo, len(c) - 1))
    return _pack(idx, bits) + np.float16(norm).tobytes()


def vllm_store_value(v: np.ndarray, bits: int) -> bytes:
    top = 2**bits - 1
    vmin, vmax = np.float32(v.min()), np.float32(v.max())
    scale = np.float32((vmax - vmin) / np.float32(top))
    scale = scale if scale > 1e-8 else np.float32(1e-8)
    q = [min(max(int(np.float32((x - vmin) / scale + np.float32(0.5))), 0), top) for x in v]
    return _pack(q, bits) + np.float16(scale).tobytes() + np.float16(vmin).tobytes()


def _pack(q: list[int], bits: int) -> bytes:
    out = bytearray()
    if bits == 4:
        for j in range(0, len(q), 2):
            out.append((q[j] & 0xF) | ((q[j + 1] & 0xF) << 4))
    else:
        for g in range(0, len(q), 8):
            word = sum((q[g + j] & 7) << (3 * j) for j in range(8))
            out += bytes([word & 0xFF, (word >> 8) & 0xFF, (word >> 16) & 0xFF])
    return bytes(out)


def vllm_read_key(raw: bytes, d: int, bits: int) -> np.ndarray:
    """_tq_full_dequant_kv for a key (norm correction on), then the inverse rotation."""
    c = _codebook(d, bits)
    data = np.frombuffer(raw, np.uint8).astype(np.int32)
    idx = []
    for i in range(d):
        off = i * bits
        raw16 = data[off // 8] | (data[off // 8 + 1] << 8 if off // 8 + 1 < len(data) else 0)
        idx.append((raw16 >> (off % 8)) & ((1 << bits) - 1))
    k = c[idx]
    k = k * np.float32(1.0 / math.sqrt(float(np.sum(k * k, dtype=np.float32)) + 1e-16))
    norm = np.frombuffer(raw[-2:], np.float16).astype(np.float32)[0]
    return (norm * k).astype(np.float32) @ hadamard(d).numpy()


def rows(d: int, n: int = 6, seed: int = 0, constant: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 2, n, d, generator=g) * torch.exp(torch.randn(d, generator=g)) + torch.randn(d, generator=g)
    if constant:  # a constant row: the value scale floor (not for keys: its rotation is exact zeros, which sit
        x[0, 1, 2] = 0.25  # on the midpoint 0, and which side a sum of +-x lands on depends on summation order)
    return x


@pytest.mark.parametrize("d, bits", [(64, 3), (128, 4), (256, 3), (256, 4)])
def test_codebook_is_vllms(d, bits):
    c = torch.tensor(lloyd_max(d, bits), dtype=torch.float32)
    assert torch.equal(c, torch.from_numpy(_codebook(d, bits)))


@pytest.mark.parametrize("d, bits", [(64, 3), (128, 4), (256, 4)])
def test_key_bytes_and_readback_equal_vllms_rule(d, bits):
    x = rows(d, seed=d + bits)
    codec = codec_from_spec(f"vllm_tq{bits}_nc", "k")
    enc = codec.encode(x, {})["bytes"]
    assert enc.shape == (1, 2, 6, math.ceil(d * bits / 8) + 2) == (1, 2, 6, codec.unit_bytes(d))
    back = codec.decode({"bytes": enc}, {}, torch.float32)
    for h in range(2):
        for t in range(6):
            want = vllm_store_key(x[0, h, t].numpy(), bits)
            assert bytes(enc[0, h, t].tolist()) == want, (h, t)
            np.testing.assert_allclose(back[0, h, t].numpy(), vllm_read_key(want, d, bits), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("d, bits", [(64, 3), (128, 4), (256, 3)])
def test_value_bytes_and_readback_equal_vllms_rule(d, bits):
    x = rows(d, seed=7 * d + bits, constant=True)
    codec = codec_from_spec(f"vllm_u{bits}", "v")
    enc = codec.encode(x, {})["bytes"]
    back = codec.decode({"bytes": enc}, {}, torch.float32)
    for h in range(2):
        for t in range(6):
            want = vllm_store_value(x[0, h, t].numpy(), bits)
            assert bytes(enc[0, h, t].tolist()) == want, (h, t)
    q = codec.encode(x, {})["bytes"][..., :-4]
    scale = enc[..., -4:-2].contiguous().view(torch.float16).float()
    zero = enc[..., -2:].contiguous().view(torch.float16).float()
    assert torch.equal(back[0, 1, 2], torch.full((d,), 0.25))  # constant row: q = 0, zero = 0.25 exactly
    assert float((back - x).abs().max()) <= float((scale / 2 + 1e-3 * zero.abs()).max()) + 1e-3
    assert q.dtype == torch.uint8


def test_presets_bytes_per_token_per_head():
    want = {"turboquant_k8v4": 388, "turboquant_4bit_nc": 262, "turboquant_k3v4_nc": 230, "turboquant_3bit_nc": 198}
    for preset, (k, v) in VLLM_TQ_PRESETS.items():
        assert engine_setting(f"vllm:{preset}") == (k, v)
        kb, vb = codec_from_spec(k, "k").unit_bytes(256), codec_from_spec(v, "v").unit_bytes(256)
        assert kb + vb == want[preset], preset  # vLLM's TurboQuantConfig.slot_size_aligned(head_dim=256)
    pol = parse_policy("vllm:turboquant_k3v4_nc")
    assert (pol.k, pol.v) == ("vllm_tq3_nc", "vllm_u4")


def test_key_rotation_needs_power_of_two_head_dim():
    with pytest.raises(ValueError, match="head_dim a power of two"):
        codec_from_spec("vllm_tq4_nc", "k").unit_bytes(96)
