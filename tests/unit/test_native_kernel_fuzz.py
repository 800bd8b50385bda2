"""The native kernel's boundary: the ragged batch against solo calls and float64 attention, and every bad argument
(shape, dtype, stride, length, batch) answered by a Python exception that names it, never a crash or garbage."""

from __future__ import annotations

import shutil

import pytest
import torch

if shutil.which("c++") is None:  # pragma: no cover - CI and this machine have g++
    pytest.skip("no C++ compiler: the native kernel cannot build here", allow_module_level=True)

from test_native_kernel import _case, _exact  # noqa: E402  (same directory: pytest puts it on sys.path)

from tqbench.kernels.cpu import native_module, native_status  # noqa: E402
from tqbench.kernels.cpu.attention import (  # noqa: E402
    kernel_rules,
    kernel_side,
    native_attention,
    native_attention_batch,
)


@pytest.fixture(scope="module", autouse=True)
def built():
    ok, why = native_status()
    assert ok, f"the native kernel must build on this machine: {why}"


def _sides(k_spec, v_spec, dt=torch.float64, **kw):
    """A valid one-store call: (query, k Side, v Side, k_rows, v_rows, mask) with k_rows/v_rows decoded in float64."""
    q, ks, vs, kd, vd, k_rows, v_rows, mask, nb = _case(k_spec, v_spec, dt=dt, **kw)
    cdt = torch.float64 if dt == torch.float64 else torch.float32
    k_side, _ = kernel_side(ks, [kd], nb, q.shape[-1], cdt)
    v_side, _ = kernel_side(vs, [vd], nb, vd.shape[-1], cdt)
    return q, k_side, v_side, k_rows, v_rows, mask


# -- the ragged batch ----------------------------------------------------------------------------------------------
def _one(k_spec, v_spec, packed, seq, seed, dt, row):
    """Sequence ``row`` of a left-padded batch (row 0: no padding) as its own store: (q, k Side, v Side, ref)."""
    q, ks, vs, kd, vd, k_rows, v_rows, mask, nb = _case(k_spec, v_spec, b=row + 1, seq=seq, packed=packed,
                                                        pad=row > 0, seed=seed, dt=dt)
    cut = slice(row, row + 1)
    for side in (ks, vs):
        side.payload = {n: t[cut] for n, t in side.payload.items()}
        side.mu = None if side.mu is None else side.mu[cut]
    q, kd, vd, k_rows, v_rows = q[cut], kd[cut], vd[cut], k_rows[cut], v_rows[cut]
    mask = None if mask is None else mask[cut]
    cdt = torch.float64 if dt == torch.float64 else torch.float32
    k_side, _ = kernel_side(ks, [kd], nb, q.shape[-1], cdt)
    v_side, _ = kernel_side(vs, [vd], nb, vd.shape[-1], cdt)
    return q, k_side, v_side, mask, _exact(q, k_rows, v_rows, mask, 0.125)


@pytest.mark.parametrize("dt", [torch.float64, torch.float32])
@pytest.mark.parametrize("seq", [1, 3])
def test_ragged_batch_matches_each_sequence_alone_and_exact_attention(dt, seq):
    """Three sequences with their own stores (lengths, codecs, dense rows, masks) in one call."""
    parts = [_one("turbo4", "turbo4", 40, seq, 20, dt, 0), _one("turbo3", "turbo2", 150, seq, 21, dt, 2),
             _one("int4", "int8", 64, seq, 22, dt, 0)]
    query = torch.cat([p[0] for p in parts])
    ks, vs, masks = [p[1] for p in parts], [p[2] for p in parts], [p[3] for p in parts]
    assert masks[1] is not None and not bool(masks[1][0, 0, :6].any())  # the middle one is left-padded
    out, call = native_attention_batch(query, ks, vs, 0.125, masks=masks)
    tol = 1e-12 if dt == torch.float64 else 3e-5
    for i, (q, k_side, v_side, mask, ref) in enumerate(parts):
        torch.testing.assert_close(out[i:i + 1].double(), ref, atol=tol, rtol=tol)
        solo, solo_call = native_attention_batch(q, [k_side], [v_side], 0.125, masks=[mask])
        torch.testing.assert_close(out[i:i + 1], solo, atol=tol, rtol=tol)
        assert call.weighted_per_sequence[i] == solo_call.weighted_rows
    assert len(call.weighted_per_sequence) == 3 and call.weighted_rows == sum(call.weighted_per_sequence)


def test_workspace_counts_the_per_thread_score_buffer():
    q, ks, vs, *_ = _sides("turbo4", "turbo4", dt=torch.float32, packed=600)
    before = torch.get_num_threads()
    try:
        sizes = {}
        for t in (1, 2):
            torch.set_num_threads(t)
            sizes[t] = native_attention_batch(q, [ks], [vs], 0.125)[1].workspace_bytes
    finally:
        torch.set_num_threads(before)
    rules = kernel_rules()
    # at 2 threads the split doubles the items (partials) and holds a second score + tile buffer
    assert sizes[2] > sizes[1] > 0
    m, d, total = 3, 64, 4 + 600 + 9
    partial = (3 * m + 2 * m * d) * 4
    assert sizes[1] >= m * min(total, rules["max_block"]) * 4 + partial  # at least one block's scores + a partial


def test_rules_come_from_the_built_kernel():
    rules = kernel_rules()
    assert rules["min_block"] == 32 and rules["simd_dim_multiple"] == 64
    assert rules["isa"] in ("avx512+vbmi", "avx512", "avx2", "generic")
    assert tuple(rules["simd_turbo_bits"]) == tuple(native_module().simd_turbo_bits())


# -- bad arguments: an exception that names the argument -------------------------------------------------------------
def _call(q, ks, vs, mask=None, **kw):
    return native_attention_batch(q, [ks], [vs], 0.125, masks=[mask], **kw)


def test_a_wrong_codes_length_names_the_argument():
    q, ks, vs, *_ = _sides("turbo4", "turbo4")
    ks.codes = ks.codes[:, :, :-1]
    with pytest.raises(RuntimeError, match=r"k_sides\[0\]\.codes has 71 rows, expected 72 \(n_packed\)"):
        _call(q, ks, vs)


def _mutations():
    """(field, how, mutate(side) -> None, expected message fragment)."""
    def shape(field, dim, delta):
        def f(s):
            t = getattr(s, field)
            sizes = list(t.shape)
            sizes[dim] += delta
            setattr(s, field, torch.zeros(sizes, dtype=t.dtype))
        return f

    def dtype(field, to):
        return lambda s: setattr(s, field, getattr(s, field).to(to))

    def stride(field):
        def f(s):
            t = getattr(s, field)
            wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
            wide[..., ::2] = t
            setattr(s, field, wide[..., ::2])
        return f

    out = []
    for field in ("codes", "norms"):
        for dim, what in ((0, "batch"), (1, "kv heads"), (2, "rows"), (3, "values per row")):
            if field == "norms" and dim == 3:
                continue
            out.append((field, f"{what}+1", shape(field, dim, 1), what))
        out.append((field, "3-D", lambda s, f=field: setattr(s, f, getattr(s, f)[0]), "must be 4-D"))
    out += [
        ("codes", "int8", dtype("codes", torch.int8), "must be Byte"),
        ("codes", "stride", stride("codes"), "unit stride"),
        ("norms", "float32", dtype("norms", torch.float32), "must be Half"),
        ("levels", "size", lambda s: setattr(s, "levels", s.levels[:-1]), "2\\*\\*bits"),
        ("levels", "dtype", dtype("levels", torch.float32), "levels must be"),
        ("rotation", "shape", lambda s: setattr(s, "rotation", s.rotation[:-1]), "rotation must be"),
        ("rotation", "transposed", lambda s: setattr(s, "rotation", s.rotation.t()), "not contiguous"),
        ("mu", "D", shape("mu", 3, -1), "values per row"),
        ("mu", "dtype", dtype("mu", torch.float32), "must be Half"),
        ("dense", "D", lambda s: setattr(s, "dense", [torch.zeros(*s.dense[0].shape[:-1], 63, dtype=torch.float64)]),
         "values per row"),
        ("dense", "dtype", lambda s: setattr(s, "dense", [s.dense[0].float()]), "must be float64 \\(the query.s dtype\\), float16 or bfloat16"),
        ("dense", "batch", lambda s: setattr(s, "dense", [s.dense[0].expand(2, -1, -1, -1)]), "batch"),
        ("dense", "stride", lambda s: setattr(s, "dense", [s.dense[0].transpose(2, 3)]), "values per row"),
        ("n_packed", "+1", lambda s: setattr(s, "n_packed", s.n_packed + 1), "expected 73"),
        ("n_packed", "-1", lambda s: setattr(s, "n_packed", -1), "n_packed must be >= 0"),
        ("n_before", "too many", lambda s: setattr(s, "n_before", 99), "n_before must be in 0..13"),
        ("bits", "9", lambda s: setattr(s, "bits", 9), "bits must be in 1..8"),
        ("bits", "3", lambda s: setattr(s, "bits", 3), "values per row, expected 24"),
        ("kind", "bogus", lambda s: setattr(s, "kind", "bogus"), "kind must be one of"),
        ("head_dim", "0", lambda s: setattr(s, "head_dim", 0), "head_dim (must be in 1..512|is 0, the query's)"),
        ("scales", "given", lambda s: setattr(s, "scales", s.norms), "scales must be None for a turbo side"),
        ("codes", "missing", lambda s: setattr(s, "codes", None), "codes is required"),
    ]
    return out


@pytest.mark.parametrize("which", ["k", "v"])
@pytest.mark.parametrize("field,how,mutate,msg", _mutations(), ids=lambda x: x if isinstance(x, str) else "")
def test_every_bad_turbo_field_is_refused_by_name(which, field, how, mutate, msg):
    q, ks, vs, k_rows, v_rows, mask = _sides("turbo4", "turbo4")
    side = ks if which == "k" else vs
    if field == "mu" and side.mu is None:
        side.mu = ks.mu.clone()  # values are not centred in this case: give V a mean to get wrong
    mutate(side)
    name = f"{which}_sides[0]"
    with pytest.raises(RuntimeError) as err:
        _call(q, ks, vs, mask)
    text = str(err.value).splitlines()[0]
    assert name in text, text
    assert __import__("re").search(msg, text), text


@pytest.mark.parametrize("field,mutate,msg", [
    ("scales", lambda s: setattr(s, "scales", s.scales[..., :-1]), r"v_sides\[0\]\.scales has 1 values per row"),
    ("zeros", lambda s: setattr(s, "zeros", s.zeros.float()), r"v_sides\[0\]\.zeros must be Half"),
    ("group", lambda s: setattr(s, "group", 5), r"v_sides\[0\]\.group \(channels per group\) must divide"),
    ("levels", lambda s: setattr(s, "levels", torch.zeros(16, dtype=torch.float64)), r"levels must be None"),
])
def test_bad_affine_token_fields_are_refused_by_name(field, mutate, msg):
    q, ks, vs, *_ = _sides("int4", "int4")
    vs.group = vs.group  # noqa: PLW0127 - the case's V group
    mutate(vs)
    with pytest.raises(RuntimeError, match=msg):
        _call(q, ks, vs)


def test_bad_kivi_block_is_refused_by_name():
    q, ks, vs, *_ = _sides("int4", "int4")
    ks.n_packed -= 1
    with pytest.raises(RuntimeError, match=r"k_sides\[0\]\.n_packed 71 is not a whole number of blocks of 4 tokens"):
        _call(q, ks, vs)
    q, ks, vs, *_ = _sides("int4", "int4")
    ks.scales = ks.scales[:, :, :-1]
    with pytest.raises(RuntimeError, match=r"k_sides\[0\]\.scales has 17 rows, expected 18 \(n_packed / group"):
        _call(q, ks, vs)


def test_bad_call_arguments_are_refused_by_name():
    q, ks, vs, k_rows, v_rows, mask = _sides("turbo4", "turbo3", pad=True, b=2)
    ok, _ = _call(q, ks, vs, mask)
    torch.testing.assert_close(ok, _exact(q, k_rows, v_rows, mask, 0.125), atol=1e-12, rtol=1e-12)
    cases = [
        (dict(q=q[:1]), r"query has batch 1, the sides hold 2 sequences"),
        (dict(q=q[:, :5]), r"query has 5 heads, not a multiple of the 3 kv heads"),
        (dict(q=q[..., :32]), r"k_sides\[0\]\.head_dim is 64, the query's head_dim is 32"),
        (dict(q=q[0]), r"query must be 4-D"),
        (dict(mask=mask[:, :, :-1]), r"masks\[0\] must be \[2, 1, 85\]"),
        (dict(mask=mask.repeat(2, 1, 1)), r"masks\[0\] must be \[2, 1, 85\]"),
        (dict(mask=mask.double()), r"masks\[0\] must be a bool CPU tensor"),
        (dict(sinks=torch.zeros(8, dtype=torch.float64)), r"sinks must be a contiguous CPU Double vector of 9"),
        (dict(sparse_v=1.5), r"sparse_v must be a softmax-weight threshold in \[0, 1\)"),
        (dict(softcap=-1.0), r"softcap must be a finite number >= 0"),
    ]
    for change, msg in cases:
        args = dict(q=q, mask=mask) | change
        extra = {k: v for k, v in change.items() if k in ("sinks", "sparse_v", "softcap")}
        with pytest.raises(RuntimeError, match=msg):
            native_attention_batch(args["q"], [ks], [vs], 0.125, masks=[args["mask"]], **extra)
    with pytest.raises(ValueError, match=r"query must be floating point \(float32, float64, or bf16/fp16, computed in fp32\), got torch.int32"):
        native_attention_batch(q.to(torch.int32), [ks], [vs], 0.125)
    with pytest.raises(RuntimeError, match=r"k_sides has 1 sides, v_sides has 2"):
        native_attention_batch(q, [ks], [vs, vs], 0.125)
    with pytest.raises(RuntimeError, match=r"k_sides is empty"):
        native_attention_batch(q, [], [], 0.125)
    with pytest.raises(RuntimeError, match=r"masks has 2 entries"):
        native_attention_batch(q, [ks], [vs], 0.125, masks=[None, None])
    vs.dense = [vs.dense[0][:, :, :-1]]
    with pytest.raises(RuntimeError, match=r"v_sides\[0\] holds 84 rows \(12 dense \+ 72 packed\), k_sides\[0\] holds 85"):
        native_attention_batch(q, [ks], [vs], 0.125, masks=[mask])


def test_wrong_types_are_refused_by_the_binding():
    with pytest.raises(TypeError):
        native_module().Side(head_dim=64, codes="not a tensor")
    with pytest.raises(TypeError):
        native_module().Side(64)  # keyword-only: a positional mix-up cannot pass


def _mutate_and_call(codecs: tuple[str, str], fields: list[str], trials: int, seed: int,
                     dtypes: tuple[torch.dtype, ...]) -> int:
    """``trials`` random one-field mutations of a valid call over ``codecs`` (K, V) sides: each must be refused
    by name (the side it mutated) or run and give finite output of the right shape. Returns how many were refused."""
    gen = torch.Generator().manual_seed(seed)
    refused = 0
    for trial in range(trials):
        q, ks, vs, *_ = _sides(*codecs, seed=trial % 5)
        side = ks if trial % 2 == 0 else vs
        name = fields[int(torch.randint(len(fields), (1,), generator=gen))]
        if name == "mu" and side.mu is None:
            name = "norms"
        t = getattr(side, name)
        t = t[0] if name == "dense" else t
        sizes = list(t.shape)
        k = int(torch.randint(len(sizes), (1,), generator=gen))
        sizes[k] = max(0, sizes[k] + int(torch.randint(-2, 3, (1,), generator=gen)))
        dts = [t.dtype, *dtypes]
        new = (torch.rand(sizes, generator=gen) * 4).to(dts[int(torch.randint(len(dts), (1,), generator=gen))])
        setattr(side, name, [new] if name == "dense" else new)
        try:
            out, _ = _call(q, ks, vs)
        except RuntimeError as exc:
            refused += 1
            assert f"{'k' if trial % 2 == 0 else 'v'}_sides[0]" in str(exc), str(exc)
            continue
        assert out.shape == (1, 9, 1, 64) and bool(torch.isfinite(out).all())
    return refused


def test_random_mutations_never_crash_or_return_garbage():
    """200 random one-field mutations of a valid call: each is refused by name, or (when it is a valid different
    store, e.g. other code values) runs and gives finite output of the right shape."""
    refused = _mutate_and_call(("turbo4", "turbo3"), ["codes", "norms", "levels", "rotation", "mu", "dense"], 200, 0,
                               (torch.uint8, torch.float16, torch.float32, torch.float64, torch.int64))
    assert refused > 150  # almost every random change is a wrong size or dtype


def test_one_store_wrapper_still_takes_padded_batches():
    q, ks, vs, kd, vd, k_rows, v_rows, mask, nb = _case("turbo2", "int2", b=3, seq=2, pad=True, dt=torch.float64)
    out, call = native_attention(q, ks, vs, kd, vd, nb, nb, mask, 0.125)
    torch.testing.assert_close(out, _exact(q, k_rows, v_rows, mask, 0.125), atol=1e-12, rtol=1e-12)
    assert len(call.weighted_per_sequence) == 3


# -- the ragged batch at the layer level (serving's fused batching) --------------------------------------------------
def _frozen(kv):
    """A copy of a ``FusedKV`` whose tensors no later append can touch."""
    import dataclasses

    def clone(part):
        kind, n, payload = part
        return kind, n, ({k: t.clone() for k, t in payload.items()} if isinstance(payload, dict) else payload.clone())

    return dataclasses.replace(kv, new_k=kv.new_k.clone(), new_v=kv.new_v.clone(),
                               k_parts=tuple(clone(p) for p in kv.k_parts), v_parts=tuple(clone(p) for p in kv.v_parts))


def test_ragged_glue_over_real_caches_equals_each_sequence_decoded_alone(tiny_engine64, monkeypatch):
    """Two sequences with their own caches (different prompt lengths, different policies) decode one step each;
    one ragged call over their captured layer-0 stores gives what each solo call gave (float64)."""
    from tqbench.engine.cache.fused import native_glue

    seen = []
    solo = native_glue.native_fused_attention

    def recording(query, kv, attention_mask, scaling, **kw):
        out = solo(query, kv, attention_mask, scaling, **kw)
        if not seen or seen[-1][1].layer is not kv.layer:
            seen.append((query.clone(), _frozen(kv), None if attention_mask is None else attention_mask.clone(),
                         scaling, out.clone()))
        return out

    model = tiny_engine64.model
    prompts = [torch.randint(5, 200, (1, n), generator=torch.Generator().manual_seed(n)) for n in (40, 57)]
    captured = []
    for ids, policy in zip(prompts, ["k=turbo3,v=turbo2,sink=2,recent=4", "k=int4,v=turbo4,sink=2,recent=4,kblock=8"]):
        cache = tiny_engine64.make_cache(policy, "fused")
        with torch.inference_mode():
            model(input_ids=ids, cache=cache)
            monkeypatch.setattr(native_glue, "native_fused_attention", recording)
            seen.clear()
            model(input_ids=ids[:, -1:], cache=cache)
            monkeypatch.setattr(native_glue, "native_fused_attention", solo)
        captured.append(seen[0])  # layer 0 of the decode step
    (qa, kva, ma, sc, oa), (qb, kvb, mb, _, ob) = captured
    assert kva.new_k.shape[2] == 1 and sum(p[1] for p in kva.k_parts) != sum(p[1] for p in kvb.k_parts)
    assert any(p[0] == "packed" for p in kva.k_parts) and any(p[0] == "packed" for p in kvb.k_parts)
    out = native_glue.native_fused_attention_ragged(torch.cat([qa, qb]), [kva, kvb], [ma, mb], sc)
    assert not isinstance(out, str), out
    torch.testing.assert_close(out[:1], oa, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(out[1:], ob, atol=1e-12, rtol=1e-12)
    with pytest.raises(ValueError, match="masks has 1 entries for 2 sequences"):
        native_glue.native_fused_attention_ragged(torch.cat([qa, qb]), [kva, kvb], [ma], sc)


def test_packed_side_descriptions_live_and_die_with_their_stores(tiny_engine):
    """The per-store kernel description is rebuilt when the packed run changes and is dropped with the cache."""
    import gc

    from tqbench.engine.cache.fused.layout import _SIDES

    gc.collect()
    before = len(_SIDES)
    old = {id(store) for store in list(_SIDES.keys())}  # stores other tests still hold (module fixtures)
    ids = torch.randint(5, 200, (1, 50), generator=torch.Generator().manual_seed(9))
    cache = tiny_engine.make_cache("turbo4,recent=4", "fused")
    with torch.inference_mode():
        tiny_engine.model(input_ids=ids[:, :40], cache=cache)
        for t in range(40, 50):  # the tail fills and flushes: the packed run grows under the cached descriptions
            tiny_engine.model(input_ids=ids[:, t:t + 1], cache=cache)
    assert cache.report().fused_impl == {"native-cpu": cache.report().fused_calls}
    layers = len(cache.layers)
    assert len(_SIDES) == before + 2 * layers  # one K and one V description per layer's store
    # (a decode step refreshes the kept description in place: ``cache.step``'s LayerStep points it at each call's rows)
    n_packed = [side.n_packed for store, (_, side) in list(_SIDES.items()) if id(store) not in old]
    assert len(n_packed) == 2 * layers
    assert min(n_packed) > 36  # refreshed after the flushes (the prefill packed 36 rows)
    del cache
    gc.collect()
    assert len(_SIDES) == before


# -- the rest of the boundary: dense sides, strides, lengths, devices, the encode call, every byte counted -----------
@pytest.mark.parametrize("field", ["codes", "norms", "scales", "zeros", "levels", "rotation", "mu"])
def test_a_dense_side_given_a_packed_field_is_refused_by_name(field):
    """A dense side reads only its row chunks: a packed tensor handed to it is the caller's mistake, not ignored."""
    q, ks, vs, *_ = _sides("turbo4", "turbo4")
    rows = torch.cat([vs.dense[0], torch.zeros(*vs.dense[0].shape[:2], vs.n_packed, 64, dtype=torch.float64)], 2)
    dense_v = native_module().Side(head_dim=64, dense=[rows], **{field: torch.zeros(1, dtype=torch.float16)})
    with pytest.raises(RuntimeError, match=rf"v_sides\[0\]\.{field} must be None for a dense side"):
        _call(q, ks, dense_v)


@pytest.mark.parametrize("field,mutate,msg", [
    ("dense", lambda s: setattr(s, "dense", [torch.zeros(*s.dense[0].shape[:-1], 128, dtype=torch.float64)[..., ::2]]),
     r"dense\[0\] must have unit stride along its last dimension"),
    ("dense", lambda s: setattr(s, "dense", [s.dense[0][:, :2]]), r"dense\[0\] has 2 kv heads, expected 3"),
    ("dense", lambda s: setattr(s, "dense", [s.dense[0]] * 9), r"dense takes at most 8 chunks, got 9"),
    ("dense", lambda s: setattr(s, "dense", [s.dense[0].to("meta")]), r"dense\[0\] must be a CPU tensor"),
    ("n_before", lambda s: setattr(s, "n_before", -1), r"n_before must be in 0\.\.13"),
    ("head_dim", lambda s: setattr(s, "head_dim", 1024), r"head_dim is 1024, the query's head_dim is 64"),
    ("codes", lambda s: setattr(s, "codes", s.codes.to("meta")), r"codes must be a CPU tensor"),
    ("norms", lambda s: setattr(s, "norms", s.norms[:, :, :-2]), r"norms has 70 rows, expected 72 \(n_packed\)"),
    ("levels", lambda s: setattr(s, "levels", None), r"levels \(the codebook\) is required"),
    ("rotation", lambda s: setattr(s, "rotation", None), r"rotation is required"),
    ("norms", lambda s: setattr(s, "norms", None), r"norms is required"),
])
def test_more_bad_fields_are_refused_by_name(field, mutate, msg):
    q, ks, vs, *_ = _sides("turbo4", "turbo4")
    mutate(ks)
    with pytest.raises(RuntimeError, match=r"^k_sides\[0\]\." + msg):
        _call(q, ks, vs)


def test_affine_strides_batch_heads_and_kivi_code_bytes_are_refused_by_name():
    for mutate, msg in [
        (lambda s: setattr(s, "scales", torch.zeros(*s.scales.shape[:-1], 2 * s.scales.shape[-1],
                                                   dtype=torch.float16)[..., ::2]),
         r"v_sides\[0\]\.scales must have unit stride"),
        (lambda s: setattr(s, "zeros", s.zeros.expand(2, -1, -1, -1)), r"v_sides\[0\]\.zeros has batch 2, expected 1"),
        (lambda s: setattr(s, "scales", s.scales[:, :1]), r"v_sides\[0\]\.scales has 1 kv heads, expected 3"),
        (lambda s: setattr(s, "codes", s.codes[..., :-1]), r"v_sides\[0\]\.codes has 31 values per row, expected 32"),
        (lambda s: setattr(s, "kind", "dense"), r"v_sides\[0\]: a dense side has n_packed 0, got 72"),
    ]:
        q, ks, vs, *_ = _sides("int4", "int4")
        mutate(vs)
        with pytest.raises(RuntimeError, match=msg):
            _call(q, ks, vs)
    q, ks, vs, *_ = _sides("int4", "int4")  # KIVI keys: a block of 4 tokens x 64 channels x 4 bits = 128 bytes
    ks.codes = ks.codes[..., :-1]
    with pytest.raises(RuntimeError, match=r"k_sides\[0\]\.codes has 127 values per row, expected 128"):
        _call(q, ks, vs)


def test_call_level_devices_lengths_and_scale_are_refused_by_name():
    q, ks, vs, k_rows, v_rows, mask = _sides("turbo4", "turbo3", pad=True, b=2)
    with pytest.raises(RuntimeError, match=r"query must be a CPU tensor"):
        native_module().attend(q.to("meta"), 0.125, [ks], [vs], [mask], 0.0, None, 0.0)
    with pytest.raises(RuntimeError, match=r"masks\[0\] must be \[2, 1, 85\]"):
        _call(q, ks, vs, mask[0])  # 2-D
    with pytest.raises(RuntimeError, match=r"masks\[0\] must be a bool CPU tensor"):
        _call(q, ks, vs, mask.to("meta"))
    with pytest.raises(RuntimeError, match=r"k_sides\[0\] holds 85 rows, fewer than the query's 86 tokens"):
        _call(torch.zeros(2, 9, 86, 64, dtype=torch.float64), ks, vs, None)
    with pytest.raises(RuntimeError, match=r"scale must be finite"):
        native_attention_batch(q, [ks], [vs], float("inf"), masks=[mask])
    with pytest.raises(RuntimeError, match=r"sinks must be a contiguous CPU Double vector of 9"):
        native_module().attend(q, 0.125, [ks], [vs], [mask], 0.0, torch.zeros(9, 1, dtype=torch.float64), 0.0)
    with pytest.raises(RuntimeError, match=r"query must be float32 or float64, got Half"):
        native_module().attend(q.half(), 0.125, [ks], [vs], [mask], 0.0, None, 0.0)


def test_strided_and_sliced_inputs_that_are_valid_give_exact_attention():
    """Views the checks let through (a strided query, dense rows sliced from a wider buffer, codes with a row
    stride) are read through their strides: the output equals float64 attention, never garbage."""
    q, ks, vs, k_rows, v_rows, mask = _sides("turbo4", "turbo3", pad=True, b=2)
    want = _exact(q, k_rows, v_rows, mask, 0.125)
    wide_q = torch.zeros(*q.shape[:-1], 2 * q.shape[-1], dtype=q.dtype)
    wide_q[..., 1::2] = q
    qs = wide_q[..., 1::2]  # last stride 2
    buf = torch.zeros(*ks.dense[0].shape[:2], ks.dense[0].shape[2] + 5, 64, dtype=torch.float64)
    buf[:, :, 5:] = ks.dense[0]
    ks.dense = [buf[:, :, 5:]]  # a storage offset
    codes = torch.zeros(*vs.codes.shape[:-1], vs.codes.shape[-1] + 8, dtype=torch.uint8)
    codes[..., :vs.codes.shape[-1]] = vs.codes
    vs.codes = codes[..., :vs.codes.shape[-1]]  # row stride > row bytes
    out, _ = _call(qs, ks, vs, mask)
    torch.testing.assert_close(out, want, atol=1e-12, rtol=1e-12)


def test_turbo_encode_checks_every_argument_by_name():
    from tqbench.engine.codecs import codec_from_spec

    codec = codec_from_spec("turbo3", role="v")
    x = torch.randn(1, 2, 5, 64)
    rot, lv, bnd = codec._tables(64, x.device, x.dtype)
    enc = native_module().turbo_encode
    codes, norms = enc(x, rot, lv, bnd, 3, True)
    want = codec.encode(x, {})  # the codec's own call (native here) equals the torch quantize + pack
    idx, norm = codec._quantize(x)
    from tqbench.kernels.packing import pack_bits

    assert torch.equal(codes, pack_bits(idx, 3, check=False)) and torch.equal(norms, norm)
    assert torch.equal(want["idx"], codes)
    cases = [
        ((x[0], rot, lv, bnd, 3), r"x must be 4-D"),
        ((x.double(), rot, lv, bnd, 3), r"rotation must be Double \(the rows' dtype\), got Float"),
        ((x.half(), rot, lv, bnd, 3), r"x must be float32 or float64, got Half"),
        ((x.transpose(2, 3), rot, lv, bnd, 3), r"x must be contiguous"),
        ((x.to("meta"), rot, lv, bnd, 3), r"x must be a CPU tensor"),
        ((x, rot[:-1], lv, bnd, 3), r"rotation must have shape \[64, 64\], got \[63, 64\]"),
        ((x, rot.t(), lv, bnd, 3), r"rotation must be contiguous"),
        ((x, rot, lv[:-1], bnd, 3), r"levels must have shape \[8\], got \[7\]"),
        ((x, rot, lv, bnd.double(), 3), r"bounds must be Float"),
        ((x, rot, lv, bnd, 4), r"levels must have shape \[16\], got \[8\]"),
        ((x, rot, lv, bnd, 9), r"bits must be in 1\.\.8, got 9"),
        ((x, rot, lv.reshape(1, 8), bnd, 3), r"levels must have shape \[8\], got \[1, 8\]"),
    ]
    for args, msg in cases:
        with pytest.raises(RuntimeError, match=msg):
            enc(*args, True)


def test_workspace_counts_the_conversions_to_the_compute_dtype():
    """A bf16 query is converted to fp32 on the way in and its output back on the way out: both transient
    tensors are in the call's workspace, to the byte."""
    q, ks, vs, *_ = _sides("turbo4", "turbo4", dt=torch.float32, packed=100)
    ws32 = native_attention_batch(q, [ks], [vs], 0.125)[1].workspace_bytes
    out16, call16 = native_attention_batch(q.bfloat16(), [ks], [vs], 0.125)
    assert out16.dtype == torch.bfloat16
    assert call16.workspace_bytes - ws32 == q.numel() * 4 + out16.numel() * 4
    sinks = torch.zeros(9, dtype=torch.float64)  # converted to fp32: 9 * 4 bytes more
    assert native_attention_batch(q, [ks], [vs], 0.125, sinks=sinks)[1].workspace_bytes - ws32 == 9 * 4


def test_random_affine_mutations_never_crash_or_return_garbage():
    """The random one-field mutations again over affine sides (KIVI keys, grouped values): codes, scales, zeros
    and dense rows of random sizes and dtypes are refused by name, or read as a valid store."""
    refused = _mutate_and_call(("int4", "int2"), ["codes", "scales", "zeros", "dense"], 120, 1,
                               (torch.uint8, torch.float16, torch.float32, torch.float64))
    assert refused > 90
