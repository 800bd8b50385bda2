"""Triton kernels against their torch references, on CPU under Triton's interpreter.

Shapes are tiny (the interpreter costs milliseconds per program iteration) but odd: head_dim 64/128,
history lengths that are not a multiple of the block, GQA 1/3/8, batch 1/3, every bit width, fp16/bf16/fp32
queries with per-dtype tolerances, padding masks and split-K. ``test_*_perturbed_*`` prove the checks trip
when a kernel's input or output is off by one code.
"""

from __future__ import annotations

import os

import pytest

# TRITON_INTERPRET is set by tests/conftest.py where no GPU is present (read when @triton.jit decorates)
pytest.importorskip(
    "triton", reason="triton is not installed: `pip install triton` to run the kernel tests (interpreter on CPU)"
)

import torch  # noqa: E402

from tests.unit.cache_helpers import fused_as_reference  # noqa: E402
from tqbench.engine.codecs import codec_from_spec  # noqa: E402
from tqbench.kernels.packed_attention import packed_attention  # noqa: E402
from tqbench.kernels.reference import PackedSide, packed_attention_partials  # noqa: E402
from tqbench.kernels.turbo_quantize import turbo_quantize  # noqa: E402

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="no CUDA device and TRITON_INTERPRET is not 1 (set before the kernels were imported)",
)

TOL = {torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 4e-2}
#: where the kernels run: the GPU when one is here and the interpreter is off (``benchmarks/gpu_check.sh`` sets
#: TRITON_INTERPRET=0), else the CPU under the interpreter. Inputs are drawn on the CPU, then moved.
DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET") != "1" and torch.cuda.is_available() else "cpu"


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float, what: str) -> None:
    """Readable mismatch report: how many elements are off, the worst one, where."""
    actual, expected = actual.double().cpu(), expected.double().cpu()
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    both_inf = torch.isinf(actual) & torch.isinf(expected) & (actual.sign() == expected.sign())
    err = torch.where(both_inf, 0.0, (actual - expected).abs()).nan_to_num(float("inf"))
    bad = err > atol * (1 + expected.abs().nan_to_num(0.0))
    if bad.any():
        worst = int(err.argmax())
        at = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), err.shape))
        raise AssertionError(
            f"{what}: {int(bad.sum())}/{err.numel()} elements off (atol {atol:g}); worst at {at}: "
            f"kernel {actual.reshape(-1)[worst].item():.6g} vs reference {expected.reshape(-1)[worst].item():.6g}"
        )


def make_side(spec: str, role: str, x: torch.Tensor) -> PackedSide:
    x = x.to(DEVICE)
    turbo = spec.startswith("turbo")
    codec = codec_from_spec(spec, role=role, center=turbo and role == "k")
    state = codec.calibrate(x)
    enc = codec.encode(x, state)
    d = x.shape[-1]
    if turbo:
        return PackedSide(
            "turbo", codec.bits, enc, x.shape[2], d,
            levels=codec.codebook_tensor(device=x.device, dtype=torch.float32, head_dim=d),
            rotation=codec.rotation_tensor(device=x.device, dtype=torch.float32, head_dim=d), mu=state.get("mu"),
        )
    if role == "k":
        return PackedSide("affine-channel", codec.bits, enc, x.shape[2], d, group=codec.block)
    return PackedSide("affine-token", codec.bits, enc, x.shape[2], d, group=codec.group)


# (k spec, v spec, batch, kv heads, gqa, query tokens, head_dim, packed rows, dtype, padding, splits)
CASES = [
    ("turbo4", "turbo4", 1, 1, 3, 1, 64, 37, torch.float32, False, None),
    ("turbo4", "turbo4", 3, 2, 8, 1, 128, 75, torch.float16, True, 2),
    ("turbo3", "turbo2", 1, 2, 1, 2, 64, 50, torch.bfloat16, False, 1),
    ("turbo2", "turbo3", 3, 1, 3, 1, 128, 33, torch.float32, True, 3),
    ("turbo1", "turbo1", 1, 2, 3, 1, 64, 40, torch.float32, False, 1),
    ("turbo4", "turbo1", 1, 1, 8, 2, 64, 31, torch.float16, False, 1),
    ("int8", "int4", 1, 3, 3, 1, 64, 96, torch.float32, False, 2),
    ("int8", "int8", 3, 1, 1, 1, 128, 64, torch.bfloat16, True, 1),
    ("int4", "int2", 1, 2, 8, 1, 64, 32, torch.float16, False, 1),
    ("int2", "turbo4", 1, 1, 3, 2, 64, 64, torch.float32, True, 2),
    ("turbo4", "int4", 3, 1, 3, 1, 64, 45, torch.float32, False, 1),
]


def _case_id(c) -> str:
    return f"{c[0]}-{c[1]}-b{c[2]}h{c[3]}g{c[4]}l{c[5]}d{c[6]}n{c[7]}-{str(c[8])[6:]}{'-pad' if c[9] else ''}"


def _inputs(case, seed=0):
    kspec, vspec, b, hkv, g, seq, d, n, dtype, pad, splits = case
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(b, hkv, n, d, generator=gen) + 0.5 * torch.randn(1, hkv, 1, d, generator=gen)
    v = torch.randn(b, hkv, n, d, generator=gen)
    q = torch.randn(b, hkv * g, seq, d, generator=gen)
    mask = None
    if pad:
        mask = torch.ones(b, seq, n, dtype=torch.bool)
        mask[0, :, :5] = False  # left padding of sequence 0
        if b > 1:
            mask[-1] = False  # a row with nothing to attend in the packed range
    mask = None if mask is None else mask.to(DEVICE)
    return q.to(DEVICE), make_side(kspec, "k", k), make_side(vspec, "v", v), mask, dtype, splits


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_packed_attention_matches_reference(case):
    q, ks, vs, mask, dtype, splits = _inputs(case)
    scale = q.shape[-1] ** -0.5
    ref_out, ref_lse = packed_attention_partials(q, ks, vs, mask, scale)
    out, lse = packed_attention(q.to(dtype), ks, vs, mask, scale, splits=splits)
    assert out.dtype == torch.float32 and out.shape == q.shape
    assert_close(out, ref_out, TOL[dtype], "output")
    assert_close(lse, ref_lse, TOL[dtype], "log-sum-exp")
    if mask is not None and q.shape[0] > 1:
        assert torch.all(out[-1] == 0) and torch.all(torch.isinf(lse[-1]))


@pytest.mark.parametrize("d,maxw,g,pad,dtype", [(64, 6, 3, False, torch.float32), (48, 3, 1, True, torch.float16),
                                                (128, 2, 8, False, torch.bfloat16)])
def test_pcaq_keys_match_reference(d, maxw, g, pad, dtype):
    """Calibrated keys (a width per coordinate, levels per coordinate, a transform per head) from their codes."""
    from tests.unit.pcaq_helpers import random_pcaq_side

    gen = torch.Generator().manual_seed(d)
    b, hkv, n = 2, 2, 37
    ks, _ = random_pcaq_side(b, hkv, n, d, maxw, torch.float32, gen, device=DEVICE)
    vs = make_side("turbo3", "v", torch.randn(b, hkv, n, d, generator=gen))
    q = torch.randn(b, hkv * g, 1, d, generator=gen).to(DEVICE)
    mask = None
    if pad:
        mask = torch.ones(b, 1, n, dtype=torch.bool)
        mask[1, :, :6] = False
        mask = mask.to(DEVICE)
    ref_out, ref_lse = packed_attention_partials(q, ks, vs, mask, d ** -0.5)
    out, lse = packed_attention(q.to(dtype), ks, vs, mask, d ** -0.5, splits=2)
    assert_close(out, ref_out, TOL[dtype], "output")
    assert_close(lse, ref_lse, TOL[dtype], "log-sum-exp")
    ks.payload["idx"] = ks.payload["idx"].clone()
    ks.payload["idx"][0, 1, 4, 3] ^= 0x24  # one wrong code byte: the check sees it
    bad, _ = packed_attention(q.to(torch.float32), ks, vs, mask, d ** -0.5)
    with pytest.raises(AssertionError):
        assert_close(bad, ref_out, TOL[torch.float32], "output")


def test_split_k_gives_the_same_result_as_one_split():
    q, ks, vs, mask, _, _ = _inputs(CASES[6])
    one, _ = packed_attention(q, ks, vs, mask, 0.125, splits=1)
    three, _ = packed_attention(q, ks, vs, mask, 0.125, splits=3, block_n=16)
    assert_close(three, one, 1e-5, "split-K")


@pytest.mark.parametrize("which", ["key code", "value code", "output"])
def test_packed_attention_perturbed_kernel_output_fails_the_check(which):
    """The comparison above is sharp enough to catch one changed code byte or a 1e-3 output error."""
    q, ks, vs, mask, _, _ = _inputs(CASES[0])
    ref, _ = packed_attention_partials(q, ks, vs, mask, 0.125)
    if which == "key code":
        ks.payload["idx"] = ks.payload["idx"].clone()
        ks.payload["idx"][0, 0, 3, 0] ^= 0x11
    elif which == "value code":
        vs.payload["idx"] = vs.payload["idx"].clone()
        vs.payload["idx"][0, 0, 3, 0] ^= 0x11
    out, _ = packed_attention(q, ks, vs, mask, 0.125)
    if which == "output":
        out = out.clone()
        out[0, 1, 0, 5] += 1e-3
    with pytest.raises(AssertionError, match="elements off"):
        assert_close(out, ref, TOL[torch.float32], "output")


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
@pytest.mark.parametrize("d", [64, 128])
def test_turbo_quantize_matches_codec(bits, d):
    codec = codec_from_spec(f"turbo{bits}", role="k", center=True)
    x = (torch.randn(3, 2, 7, d, generator=torch.Generator().manual_seed(bits)) * 2 + 0.7).to(DEVICE)
    state = codec.calibrate(x)
    want = codec.encode(x, state)
    got = turbo_quantize(x, state["mu"], codec.rotation_tensor(device=DEVICE, head_dim=d),
                         codec.codebook_tensor(device=DEVICE, head_dim=d), bits)
    assert got["idx"].dtype == torch.uint8 and got["idx"].shape == want["idx"].shape
    mism = (got["idx"] != want["idx"]).sum().item()
    assert mism == 0, f"{mism} of {want['idx'].numel()} packed bytes differ"
    assert torch.equal(got["norm"], want["norm"])


def test_turbo_quantize_strided_fp16_rows_without_centering():
    codec = codec_from_spec("turbo4", role="v")
    x = torch.randn(1, 7, 3, 64).to(DEVICE).transpose(1, 2).to(torch.float16)  # [1, 3, 7, 64], strided rows
    want = codec.encode(x, {})
    got = turbo_quantize(x, None, codec.rotation_tensor(device=DEVICE, head_dim=64),
                         codec.codebook_tensor(device=DEVICE, head_dim=64), 4)
    assert (got["idx"] != want["idx"]).sum().item() <= 2  # fp16 rows: a boundary tie may round apart
    assert torch.allclose(got["norm"].float(), want["norm"].float(), rtol=2e-3)


def test_turbo_quantize_perturbed_output_fails_the_check():
    codec = codec_from_spec("turbo4", role="k", center=True)
    x = torch.randn(1, 2, 5, 64).to(DEVICE)
    state = codec.calibrate(x)
    want = codec.encode(x, state)
    got = turbo_quantize(x, state["mu"], codec.rotation_tensor(device=DEVICE, head_dim=64),
                         codec.codebook_tensor(device=DEVICE, head_dim=64), 4)
    got["idx"][0, 1, 2, 7] ^= 0x01
    assert (got["idx"] != want["idx"]).sum().item() == 1


def test_launchers_check_shapes_strides_and_dtypes():
    q, ks, vs, _, _, _ = _inputs(CASES[0])
    with pytest.raises(ValueError, match="query dtype torch.float64 is not supported"):
        packed_attention(q.double(), ks, vs, None, 0.1)
    with pytest.raises(ValueError, match="mask must be"):
        packed_attention(q, ks, vs, torch.ones(1, 1, 5, dtype=torch.bool), 0.1)
    with pytest.raises(ValueError, match="head_dim mismatch"):
        packed_attention(q[..., :32], ks, vs, None, 0.1)
    q6, ks6, vs6, _, _, _ = _inputs(CASES[6])
    with pytest.raises(ValueError, match="2 query heads is not a multiple of 3 kv heads"):
        packed_attention(q6[:, :2], ks6, vs6, None, 0.1)
    bad = PackedSide("turbo", 4, {"idx": ks.payload["idx"][..., :-1], "norm": ks.payload["norm"]}, ks.n_tokens, 64,
                     levels=ks.levels, rotation=ks.rotation)
    with pytest.raises(ValueError, match=r"k\.idx: expected \[batch=1, kv_heads=1, units, 32\], got \(1, 1, 37, 31\)"):
        packed_attention(q, bad, vs, None, 0.1)
    strided = PackedSide("turbo", 4, {"idx": ks.payload["idx"].transpose(2, 3).contiguous().transpose(2, 3),
                                      "norm": ks.payload["norm"]}, ks.n_tokens, 64, levels=ks.levels,
                         rotation=ks.rotation)
    with pytest.raises(ValueError, match="last dimension must be contiguous"):
        packed_attention(q, strided, vs, None, 0.1)
    def side(base, **change):
        fields = dict(kind=base.kind, bits=base.bits, payload=dict(base.payload), n_tokens=base.n_tokens,
                      head_dim=base.head_dim, group=base.group, levels=base.levels, rotation=base.rotation, mu=base.mu)
        payload = change.pop("payload", {})
        fields["payload"].update(payload)
        return PackedSide(**(fields | change))

    norm = ks.payload["norm"]
    turbo_cases = [
        (dict(payload={"norm": norm[:, :, :-1]}), r"k\.norm holds 36 units, fewer than the 37"),
        (dict(payload={"norm": norm.expand(1, 1, 37, 2)}), r"k\.norm: expected \[batch=1, kv_heads=1, units, 1\]"),
        (dict(payload={"norm": norm.double()}), r"k\.norm must be torch.float16 or torch.float32, got torch.float64"),
        (dict(payload={"idx": ks.payload["idx"].to(torch.int8)}), r"k\.idx must be torch.uint8"),
        (dict(payload={"idx": ks.payload["idx"][:, :, :-1]}), r"k\.idx holds 36 units, fewer than the 37"),
        (dict(payload={"idx": ks.payload["idx"].expand(2, -1, -1, -1)}), r"k\.idx: expected \[batch=1"),
        (dict(levels=ks.levels[:-1]), r"k\.levels must hold the 16 codebook values"),
        (dict(rotation=ks.rotation[:, :-1]), r"k\.rotation must be \[64, 64\]"),
        (dict(mu=torch.zeros(1, 1, 1, 63)), r"k\.mu must be \[1 or 1, 1, 1, 64\]"),
        (dict(payload={"norm": None}), r"k\.norm must be a tensor, got NoneType"),
    ]
    for change, msg in turbo_cases:
        with pytest.raises(ValueError, match=msg):
            packed_attention(q, side(ks, **change), vs, None, 0.1)
    with pytest.raises(ValueError, match=r"v\.norm holds 36 units"):
        packed_attention(q, ks, side(vs, payload={"norm": vs.payload["norm"][:, :, :-1]}), None, 0.1)
    with pytest.raises(ValueError, match=r"mask must be bool \(True = attend\), got torch.float32"):
        packed_attention(q, ks, vs, torch.ones(1, 1, 37), 0.1)
    with pytest.raises(ValueError, match=r"q_rot must have the query's shape"):
        packed_attention(q, ks, vs, None, 0.1, q_rot=q[..., :32])
    q6, ks6, vs6, _, _, _ = _inputs(CASES[6])  # KIVI int8 keys, int4 values in groups
    affine_cases = [
        ((side(ks6, payload={"scale": ks6.payload["scale"][..., :-1]}), vs6), r"k\.scale: expected \[batch=1, kv_heads=3, units, 64\]"),
        ((ks6, side(vs6, payload={"zero": vs6.payload["zero"].float()})), r"v\.zero must match v\.scale in dtype"),
        ((ks6, side(vs6, payload={"zero": vs6.payload["zero"].transpose(0, 2).contiguous().transpose(0, 2)})),
         r"v\.zero must match v\.scale in dtype and strides"),
        ((ks6, side(vs6, group=0)), r"v\.group must be >= 1, got 0"),
        ((ks6, side(vs6, group=5)), r"v: head_dim 64 is not a multiple of the group 5"),
        ((ks6, side(vs6, payload={"q": None, "scale": vs6.payload["scale"]})), r"v\.q must be a tensor"),
    ]
    for (k_side, v_side), msg in affine_cases:
        with pytest.raises(ValueError, match=msg):
            packed_attention(q6, k_side, v_side, None, 0.1)
    with pytest.raises(ValueError, match="row dtype torch.float64 is not supported"):
        turbo_quantize(torch.zeros(1, 1, 2, 64, dtype=torch.float64), None, ks.rotation, ks.levels, 4)
    with pytest.raises(ValueError, match="levels must hold 16 values"):
        turbo_quantize(torch.zeros(1, 1, 2, 64), None, ks.rotation, ks.levels[:8], 4)
    x = torch.zeros(1, 1, 2, 64)
    for args, msg in [
        ((x[0], None, ks.rotation, ks.levels, 4), r"x \(the rows\) must be \[batch, kv_heads, tokens, head_dim\]"),
        ((x.transpose(2, 3), None, ks.rotation, ks.levels, 4), r"x: the last dimension must be contiguous"),
        ((x, None, ks.rotation[:32], ks.levels, 4), r"rotation must be \[64, 64\], got \(32, 64\)"),
        ((x, None, ks.rotation.to(torch.int32), ks.levels, 4), r"rotation must be a floating-point tensor, got torch.int32"),
        ((x, torch.zeros(1, 2, 1, 64), ks.rotation, ks.levels, 4), r"mu must be \[1, 1, 1, 64\], got \(1, 2, 1, 64\)"),
        ((x, "mu", ks.rotation, ks.levels, 4), r"mu must be a floating-point tensor, got str"),
        ((x, None, ks.rotation, ks.levels, 9), r"bits must be an integer in 1\.\.8, got 9"),
    ]:
        with pytest.raises(ValueError, match=msg):
            turbo_quantize(*args)


@pytest.mark.parametrize("policy", ["turbo4", "k=int8,v=turbo3,sink=2,recent=4"])
def test_fused_mode_runs_the_kernels_end_to_end(tiny_engine, monkeypatch, policy):
    """TQBENCH_FUSED_IMPL=triton runs the kernels (interpreter) inside the model: same tokens as the reference."""
    ref, got = fused_as_reference(tiny_engine, policy, monkeypatch)
    rep = got.cache_report
    assert rep.fused_impl == {"triton": rep.fused_calls} and rep.fused_calls > 0
    assert list(ref.cache_report.fused_impl) == ["torch-reference (TQBENCH_FUSED_IMPL=torch)"]
    if policy == "turbo4":
        assert rep.fallbacks == {}
        assert rep.resident_decode_bytes == rep.compressed_storage_bytes  # kernels: nothing decoded resident
    else:  # KIVI keys pack whole blocks: the values packed beyond them are decoded per call, and counted
        assert any(k.startswith("triton: decoded turbo3 rows beyond") for k in rep.fallbacks), rep.fallbacks


def test_kernel_path_multi_token_chunk_and_padding_match_reference(tiny_engine, monkeypatch):
    """Through the kernels: a left-padded batch, then several new tokens at once over packed history."""
    model = tiny_engine.model
    ids = torch.randint(5, 200, (2, 56), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :7] = 0  # left padding of the second sequence
    logits = {}
    for impl in ("torch", "triton"):
        monkeypatch.setenv("TQBENCH_FUSED_IMPL", impl)
        cache = tiny_engine.make_cache("turbo4", "fused")
        with torch.inference_mode():
            model(input_ids=ids[:, :48], attention_mask=mask[:, :48], cache=cache)
            logits[impl] = model(input_ids=ids[:, 48:], attention_mask=mask, cache=cache).logits
        assert set(cache.report().fused_impl) == {"triton" if impl == "triton" else
                                                  "torch-reference (TQBENCH_FUSED_IMPL=torch)"}
    assert_close(logits["triton"], logits["torch"], 1e-4, "logits")


# -- the GPU append path and the interpreter switch -----------------------------------------------------------------
@pytest.mark.parametrize("bits,center", [(1, False), (3, True), (4, True)])
def test_turbo_codec_gpu_append_path_is_the_quantize_kernel(bits, center):
    """``TurboCodec.encode`` on a CUDA tensor calls ``_triton_quantize_pack`` (kernels/turbo_quantize.py): run here
    on the interpreter, it gives the torch reference's packed bytes and norms exactly."""
    from tqbench.kernels.packing import pack_bits

    codec = codec_from_spec(f"turbo{bits}", role="k", center=center)
    x = (torch.randn(2, 3, 9, 64, generator=torch.Generator().manual_seed(bits)) * 1.5 + 0.4).to(DEVICE)
    state = codec.calibrate(x)
    xc = codec._center(x, state)
    got = codec._triton_quantize_pack(xc)
    idx, norm = codec._quantize(xc)
    assert got is not None and getattr(codec, "encoder_fallback", None) is None
    mism = int((got["idx"] != pack_bits(idx, bits, check=False)).sum())
    assert mism == 0, f"{mism} packed bytes differ"
    assert torch.equal(got["norm"], norm)


@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device: encode() takes the Triton path on CUDA tensors only")
def test_turbo_codec_encode_on_cuda_runs_the_kernel(monkeypatch):
    codec = codec_from_spec("turbo4", role="k", center=True)
    x = torch.randn(1, 2, 7, 128).to(DEVICE)
    state = codec.calibrate(x)
    calls = []
    kernel = codec._triton_quantize_pack
    monkeypatch.setattr(codec, "_triton_quantize_pack", lambda xc: calls.append(xc.shape) or kernel(xc))
    enc = codec.encode(x, state)
    assert calls == [x.shape] and getattr(codec, "encoder_fallback", None) is None
    torch.testing.assert_close(codec.decode(enc, state, torch.float32), x, atol=0.5, rtol=0.5)


def test_turbo_codec_says_why_the_quantize_kernel_did_not_run(monkeypatch):
    import tqbench.kernels as kernels

    codec = codec_from_spec("turbo4", role="v")
    assert codec._triton_quantize_pack(torch.zeros(1, 1, 2, 64, dtype=torch.float64)) is None
    assert codec.encoder_fallback == ("quantize-and-pack ran in torch (torch.float64 rows: the Triton kernel "
                                      "computes in fp32)")
    monkeypatch.setattr(kernels, "triton_status", lambda: (False, "no CUDA device"))
    assert codec._triton_quantize_pack(torch.zeros(1, 1, 2, 64)) is None
    assert codec.encoder_fallback == "quantize-and-pack ran in torch (the Triton kernel cannot run: no CUDA device)"


def test_the_interpreter_is_switched_on_only_where_no_gpu_is_present(monkeypatch):
    from tqbench.kernels import needs_interpreter

    if not torch.cuda.is_available():  # this session: tests/conftest.py set it (unless the caller gave it)
        assert os.environ.get("TRITON_INTERPRET") == "1"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert needs_interpreter() is False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert needs_interpreter() is True
