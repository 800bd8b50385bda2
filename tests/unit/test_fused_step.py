"""A plain fused layer's decode step in one native call (``cache.step``): ``LayerStep.step`` points the layer's kernel
sides at the rows as of the call and appends the call's K and V rows (``append_rows``); where a store needs more,
``append_step`` appends both stores in one call, and anything else takes the general path (``append_points`` per store,
the glue's ``store_sides``). All three leave the same stores, byte for byte, and the same logits."""

from __future__ import annotations

import pytest
import torch

import tqbench.engine.cache.layer as layer_mod
import tqbench.engine.cache.step as step_mod
from tqbench.engine.cache.fused import native_glue
from tqbench.engine.cache.layer import TQLayer
from tqbench.engine.cache.store import KVStore
from tqbench.engine.codecs import codec_from_spec
from tqbench.engine.policy import parse_policy
from tqbench.kernels.cpu import native_status

pytestmark = pytest.mark.skipif(not native_status()[0], reason=native_status()[1])


def _decode(engine, policy: str, steps: int = 40):
    """A fused cache after a 12-token prefill and ``steps`` one-token steps: every step's logits and every store."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, engine.model.config.vocab_size, (1, 12 + steps), generator=g)
    cache = engine.make_cache(policy, "fused")
    logits = []
    with torch.inference_mode():
        for a, b in [(0, 12), *((t, t + 1) for t in range(12, 12 + steps))]:
            logits.append(engine.model(input_ids=ids[:, a:b], cache=cache, use_cache=True).logits[:, -1].clone())
    stores = []
    for layer in cache.layers:
        for st in (layer.k_store, layer.v_store):
            tail = st.tail.view()
            stores.append(({k: t.clone() for k, t in st.packed_view().items()}, None if tail is None else tail.clone(),
                           (st.seen, st.n_packed, st.tail.n, st.head.n, st.peak_dense_bytes, st.append_path)))
    return torch.stack(logits), stores, cache.report()


def _same(a, b) -> None:
    assert torch.equal(a[0], b[0])
    for (pa, ta, ma), (pb, tb, mb) in zip(a[1], b[1], strict=True):
        assert ma == mb
        assert pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)
        assert (ta is None and tb is None) or torch.equal(ta, tb)
    assert a[2].fused_impl == b[2].fused_impl
    step = "decode step not in one native call"  # (said only where the one-call path was tried: the fast run)
    assert [n for n in a[2].notes if step not in n] == [n for n in b[2].notes if step not in n]


POLICIES = ["turbo4,recent=2", "k=turbo4|turbo2,v=turbo2|turbo3,sink=2,recent=3", "turbo3,sink=0,recent=0",
            "k=turbo4,v=int4,recent=2"]


@pytest.mark.parametrize("policy", POLICIES)
def test_one_call_step_leaves_the_general_paths_stores_and_logits(tiny_engine64, policy, monkeypatch):
    calls = {"step": 0, "sides": 0}
    orig_plan = step_mod._new_plan

    def counted_plan(*args):
        plan = orig_plan(*args)
        calls["sides"] += 1
        return plan

    monkeypatch.setattr(step_mod, "_new_plan", counted_plan)
    fast = _decode(tiny_engine64, policy)
    layers = tiny_engine64.model.config.num_hidden_layers
    if "int4" not in policy:  # (an int4 V store has no native encoder: the general path, said below)
        assert calls["sides"] == layers  # the sides are built once per layer, then kept
    monkeypatch.setattr(layer_mod, "fused_step", lambda *a: None)
    pair = _decode(tiny_engine64, policy)  # K and V appended by one append_rows call per step
    monkeypatch.setattr(layer_mod, "append_step", lambda *a: False)
    general = _decode(tiny_engine64, policy)  # store by store, the glue's store_sides every call
    _same(fast, general)
    _same(pair, general)
    if "int4" not in policy:  # (int4 values have no native kernel: the torch reference, the same in all three)
        assert fast[2].fused_impl == {"native-cpu": fast[2].fused_calls}


def test_a_decode_step_is_one_native_call_and_no_side_is_rebuilt(tiny_engine64, monkeypatch):
    """After the first steps, a step of a plain layer calls ``LayerStep.step`` once and neither appends store by
    store nor builds kernel sides; the glue hands the kept sides to the kernel."""
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, tiny_engine64.model.config.vocab_size, (1, 30), generator=g)
    cache = tiny_engine64.make_cache("turbo4,recent=2", "fused")
    with torch.inference_mode():
        tiny_engine64.model(input_ids=ids[:, :12], cache=cache, use_cache=True)
        for t in range(12, 15):
            tiny_engine64.model(input_ids=ids[:, t : t + 1], cache=cache, use_cache=True)
        seen = {"append_points": 0, "store_side": 0}
        for name, mod, key in (("append_points", KVStore, "append_points"),
                               ("store_side", native_glue, "kernel_sides")):
            orig = getattr(mod, key)

            def counted(*a, _orig=orig, _name=name, **k):
                seen[_name] += 1
                return _orig(*a, **k)

            monkeypatch.setattr(mod, key, counted)
        for t in range(15, 30):
            tiny_engine64.model(input_ids=ids[:, t : t + 1], cache=cache, use_cache=True)
    assert seen == {"append_points": 0, "store_side": 0}
    assert all(layer._step.native is not None for layer in cache.layers)
    assert cache.report().fused_impl == {"native-cpu": cache.report().fused_calls}


def _layer(policy="turbo4,recent=2", rows=20, dtype=torch.float32):
    pol = parse_policy(policy)
    layer = TQLayer(pol.plan(2)[1], "fused", pol, kv_heads=3)
    g = torch.Generator().manual_seed(3)
    with torch.inference_mode():
        layer.update(torch.randn(1, 3, rows, 64, generator=g, dtype=dtype),
                     torch.randn(1, 3, rows, 64, generator=g, dtype=dtype))
        for _ in range(3):
            layer.update(torch.randn(1, 3, 1, 64, generator=g, dtype=dtype),
                         torch.randn(1, 3, 1, 64, generator=g, dtype=dtype))
    return layer


def test_layer_step_checks_every_index_before_writing():
    layer = _layer()
    plan, ks = layer._step, layer.k_store
    k = v = torch.zeros(1, 3, 1, 64)
    state = (ks.tail.state(), ks.n_packed, ks.seen, {n: b.state() for n, b in ks.packed.items()})
    before = {n: t.clone() for n, t in ks.packed_view().items()}
    good = [ks.head.n, ks.head.start, ks.tail.start, ks.tail.n, ks.tail.start + ks.tail.n, 0, ks.n_packed]
    good += [x for b in plan.bufs[0][1] for x in (b.start, b.start + b.n)]
    vs = layer.v_store
    good_v = [vs.head.n, vs.head.start, vs.tail.start, vs.tail.n, vs.tail.start + vs.tail.n, 0, vs.n_packed]
    good_v += [x for b in plan.bufs[1][1] for x in (b.start, b.start + b.n)]
    with pytest.raises(RuntimeError, match="takes 22 integers"):
        plan.native.step(k, v, good[:-1] + good_v)
    bad = list(good)
    bad[4] = plan.data[2].shape[2]  # the call's row past the tail buffer
    with pytest.raises(RuntimeError, match="K store: tail rows .* outside its tail buffer"):
        plan.native.step(k, v, bad + good_v)
    bad = list(good)
    bad[6] = 10**6  # more packed rows than the buffer holds
    with pytest.raises(RuntimeError, match="K store: packed buffer 0: rows"):
        plan.native.step(k, v, bad + good_v)
    with pytest.raises(RuntimeError, match="V store: rows .* do not match the tail buffer"):
        plan.native.step(k, torch.zeros(1, 3, 1, 32), good + good_v)
    assert (ks.tail.state(), ks.n_packed, ks.seen, {n: b.state() for n, b in ks.packed.items()}) == state
    assert all(torch.equal(before[n], t) for n, t in ks.packed_view().items())


def test_a_failed_step_leaves_the_stores_as_they_were(monkeypatch):
    layer = _layer()
    ks, vs = layer.k_store, layer.v_store
    marks = [(s.tail.state(), s.n_packed, s.seen, {n: b.state() for n, b in s.packed.items()}) for s in (ks, vs)]

    class Broken:
        def step(self, *a):
            raise RuntimeError("broken step")

    layer._step.native = Broken()
    with pytest.raises(RuntimeError, match="broken step"), torch.inference_mode():
        layer.update(torch.zeros(1, 3, 1, 64), torch.zeros(1, 3, 1, 64))
    assert [(s.tail.state(), s.n_packed, s.seen, {n: b.state() for n, b in s.packed.items()})
            for s in (ks, vs)] == marks


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_append_step_packs_what_append_points_packs(dtype):
    """Two stores appended by one ``append_rows`` call per step equal the same stores appended one by one, every
    byte, through buffer growth (the tail's and the packed runs')."""
    from tqbench.engine.cache.step import append_step

    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 3, 90, 64, generator=g, dtype=torch.float64).to(dtype)
    y = torch.randn(2, 3, 90, 64, generator=g, dtype=torch.float64).to(dtype)
    mk = [lambda: KVStore(codec_from_spec("turbo4", role="k", center=True), sink=2, recent=3),
          lambda: KVStore(codec_from_spec("turbo2|turbo3|turbo1", role="v"), sink=2, recent=3)]
    one, two = [f() for f in mk], [f() for f in mk]
    took = 0
    for s, r in zip(one, (x, y)):
        s.append(r[:, :, :10])
    for s, r in zip(two, (x, y)):
        s.append(r[:, :, :10])
    for t in range(10, 90):
        for s, r in zip(one, (x, y)):
            s.append_points(r[:, :, t : t + 1], None, False)
        rows = (x[:, :, t : t + 1], y[:, :, t : t + 1])
        if append_step(two, rows):
            took += 1
        else:
            for s, r in zip(two, rows):
                s.append_points(r, None, False)
    assert took >= 85 - 10  # (the first steps after the prefill build the encoder and buffers: general path)
    for a, b in zip(one, two):
        assert (a.seen, a.n_packed, a.tail.n, a.head.n, a.peak_dense_bytes) == \
               (b.seen, b.n_packed, b.tail.n, b.head.n, b.peak_dense_bytes)
        pa, pb = a.packed_view(), b.packed_view()
        assert pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)
        assert torch.equal(a.tail.view(), b.tail.view())


def test_a_copied_layer_makes_its_own_step_and_both_decode_alike():
    """A compressed context is forked by ``copy.deepcopy`` (``context.fork``): the kept step (native, over the
    original's buffers) is left out of the copy, which builds its own; both then append the same rows alike."""
    import copy

    layer = _layer()
    twin = copy.deepcopy(layer)
    assert layer._step is not None and twin._step is None
    g = torch.Generator().manual_seed(5)
    with torch.inference_mode():
        for _ in range(4):
            k, v = torch.randn(1, 3, 1, 64, generator=g), torch.randn(1, 3, 1, 64, generator=g)
            layer.update(k, v)
            twin.update(k, v)
    assert twin._step is not None and twin._step.native is not layer._step.native
    for a, b in ((layer.k_store, twin.k_store), (layer.v_store, twin.v_store)):
        pa, pb = a.packed_view(), b.packed_view()
        assert a.n_packed == b.n_packed and all(torch.equal(pa[n], pb[n]) for n in pa)
        assert torch.equal(a.tail.view(), b.tail.view())


def test_the_report_says_why_a_decode_step_is_not_one_native_call(tiny_engine64):
    ids = torch.randint(5, 200, (1, 40))
    notes = tiny_engine64.generate(ids, "k=turbo4,v=int4", "fused", max_new_tokens=4,
                                   stop_at_eos=False).cache_report.notes
    assert ("decode step not in one native call (the V store: no native encoder for int4): the stores appended "
            "one by one") in notes
    notes = tiny_engine64.generate(ids, "turbo4", "fused", max_new_tokens=4, stop_at_eos=False).cache_report.notes
    assert not [n for n in notes if "decode step not in one native call" in n]
