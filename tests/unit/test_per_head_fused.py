"""Per-KV-head layers in the fused mode: each group of heads is attended with its own K and V codecs, its output
written into its query heads; on the native CPU kernel the whole layer is one call (a side per group of heads),
on Triton and the torch reference one call per group; the report says what ran per group."""

from __future__ import annotations

import pytest
import torch

from tests.unit.cache_helpers import fused_as_reference
from tqbench.engine.batch import decode_step

PROMPT = "the quick brown fox jumps over the lazy dog and keeps running far away " * 2
# group 0: turbo4 K / turbo2 V (native); group 1: KIVI int4 K (32-token blocks) / turbo2 V (native)
NATIVE_POLICY = "k=turbo4|int4,v=turbo2,sink=2,recent=3"
POLICIES = [NATIVE_POLICY, "k=turbo2|turbo4,v=turbo3|turbo2,recent=2", "kv=turbo3|fp16,sink=1"]


@pytest.fixture(scope="module")
def engine64():
    from tqbench.engine.engine import Engine

    engine = Engine.tiny(dtype=torch.float64)  # its own model: the fused mode reroutes the model's attention
    engine.enable_fused()
    return engine


def _native_ok():
    from tqbench.kernels.cpu import native_status

    return native_status()[0]


@pytest.mark.parametrize("impl", ["native", "torch"])
@pytest.mark.parametrize("policy", POLICIES)
def test_fused_per_head_gives_the_compressed_tokens_in_float64(engine64, monkeypatch, impl, policy):
    if impl == "native" and not _native_ok():
        pytest.skip("no native kernel here")
    monkeypatch.setenv("TQBENCH_FUSED_IMPL", impl)
    ids = engine64.encode_prompt(PROMPT, chat=False)
    want = engine64.generate(ids, policy, "compressed", max_new_tokens=16, stop_at_eos=False)
    got = engine64.generate(ids, policy, "fused", max_new_tokens=16, stop_at_eos=False)
    assert got.token_ids == want.token_ids
    rep = got.cache_report
    assert rep.compressed_storage_bytes == want.cache_report.compressed_storage_bytes
    label = "native-cpu" if impl == "native" else "torch-reference (TQBENCH_FUSED_IMPL=torch)"
    # every group of every layer call ran on the chosen implementation, and the report names each group; the
    # native kernel takes the layer's groups in one call, the reference runs one call per group
    calls = rep.fused_calls if impl == "native" else 2 * rep.fused_calls
    assert rep.fused_impl == {label: calls} and rep.fallbacks == {}
    heads = {g.rsplit(" heads ", 1)[1] for g in rep.fused_groups}
    assert heads == {"0", "1"} and all(ran == {label: rep.fused_calls} for ran in rep.fused_groups.values())
    assert any(n.startswith("fused per-head groups") for n in rep.notes)


def test_a_group_without_a_native_kernel_falls_back_alone_and_says_so(engine64, monkeypatch):
    if not _native_ok():
        pytest.skip("no native kernel here")
    monkeypatch.setenv("TQBENCH_FUSED_IMPL", "native")
    ids = engine64.encode_prompt(PROMPT, chat=False)
    policy = "k=turbo4|turbo3.5,v=turbo2,recent=2"  # the outlier split has no kernel: its group falls back
    want = engine64.generate(ids, policy, "compressed", max_new_tokens=12, stop_at_eos=False)
    got = engine64.generate(ids, policy, "fused", max_new_tokens=12, stop_at_eos=False)
    assert got.token_ids == want.token_ids
    rep = got.cache_report
    groups = rep.fused_groups
    assert set(groups["k=turbo4 v=turbo2 heads 0"]) == {"native-cpu"}
    assert set(groups["k=turbo3.5 v=turbo2 heads 1"]) == {
        "torch-reference (native kernel: no native kernel for turbo3.5)"}
    assert "native: no native kernel for turbo3.5 (torch reference) [k=turbo3.5 v=turbo2 heads 1]" in rep.fallbacks
    # the one call per layer could not run, and the report says why
    assert ("native: no native kernel for turbo3.5 (k=turbo3.5 v=turbo2 heads 1): the layer's groups of heads ran "
            "one call each") in rep.fallbacks


def test_a_verification_call_on_a_per_head_fused_layer_reads_as_one_at_a_time(engine64, monkeypatch):
    """Speculation on a per-head fused cache: five drafts in one call give the logits of five one-token calls,
    and a crop of two leaves the cache three one-token calls leave."""
    if _native_ok():
        monkeypatch.setenv("TQBENCH_FUSED_IMPL", "native")
    ids = torch.randint(4, 260, (1, 37), generator=torch.Generator().manual_seed(3))

    def feed(cache, x):
        with torch.inference_mode():
            return engine64.model(input_ids=x, cache=cache, use_cache=True).logits[0]

    one, spec = (engine64.make_cache(NATIVE_POLICY, "fused") for _ in range(2))
    feed(one, ids[:, :30])
    feed(spec, ids[:, :30])
    want = torch.stack([feed(one, ids[:, 30 + i : 31 + i])[-1] for i in range(5)])
    spec.activate_past_recording()
    got = feed(spec, ids[:, 30:35])
    assert (got - want).abs().max() < 1e-9
    spec.crop(-2)
    ref = engine64.make_cache(NATIVE_POLICY, "fused")
    feed(ref, ids[:, :30])
    for i in range(3):
        feed(ref, ids[:, 30 + i : 31 + i])
    assert spec.report().compressed_storage_bytes == ref.report().compressed_storage_bytes
    for a, b in zip(spec.layers, ref.layers):
        for name, t in a.k_store.packed_view().items():
            if t.dtype == torch.uint8:
                assert torch.equal(t, b.k_store.packed_view()[name])
    torch.testing.assert_close(feed(spec, ids[:, 33:34]), feed(ref, ids[:, 33:34]), rtol=0, atol=1e-9)


def test_a_fused_per_head_batch_runs_one_ragged_call_per_layer_and_gives_solo_tokens(engine64, monkeypatch):
    if not _native_ok():
        pytest.skip("no native kernel here")
    from tqbench.engine.cache.fused import native_glue

    prompts = ["Say hello.", "Count to five, slowly and carefully, please.", "What is a cache?"]
    budgets = [9, 12, 6]
    msgs = [[{"role": "user", "content": p}] for p in prompts]
    solo = [engine64.generate(m, NATIVE_POLICY, "fused", max_new_tokens=n, stop_at_eos=False).token_ids
            for m, n in zip(msgs, budgets)]
    calls = []
    ragged = native_glue.native_fused_attention_ragged

    def counted(query, kvs, *args, **kwargs):
        calls.append((len(kvs), query.shape[1]))
        return ragged(query, kvs, *args, **kwargs)

    monkeypatch.setattr(native_glue, "native_fused_attention_ragged", counted)
    seqs = [engine64.sequence(engine64.encode_prompt(m), NATIVE_POLICY, "fused", max_new_tokens=n,
                              stop_at_eos=False, run=str(i)) for i, (m, n) in enumerate(zip(msgs, budgets))]
    for s in seqs:
        s.start()
    active = list(seqs)
    steps = 0
    while active:
        for s in active:
            s.step()
        active = [s for s in active if not s.done]
        if active:
            decode_step(engine64.model, active)
            steps += 1
    assert [s.result.token_ids for s in seqs] == solo
    batched = [c for c in calls if c[0] > 1]
    # one call per layer per batched step, every query head in it (2 groups of 1 KV head, 2 query heads each)
    assert batched and all(c[1] == 4 for c in batched)
    assert len(batched) % len(engine64.model.model.layers) == 0


def test_fused_per_head_through_the_triton_kernels_matches_the_reference(monkeypatch):
    from tqbench.engine.engine import Engine
    from tqbench.kernels import triton_status

    if not triton_status()[0]:
        pytest.skip(triton_status()[1])
    engine = Engine.tiny()
    policy = "k=turbo4|turbo2,v=turbo3,sink=2,recent=4"
    _, got = fused_as_reference(engine, policy, monkeypatch)
    rep = got.cache_report
    assert rep.fused_impl == {"triton": 2 * rep.fused_calls} and rep.fallbacks == {}
    assert set(rep.fused_groups) == {"k=turbo4 v=turbo3 heads 0", "k=turbo2 v=turbo3 heads 1"}


def _decode_logits(engine, policy: str, ids, steps: int) -> torch.Tensor:
    cache, out = engine.make_cache(policy, "fused"), []
    with torch.inference_mode():
        logits = engine.model(input_ids=ids, cache=cache).logits[:, -1:]
        for _ in range(steps):
            out.append(logits)
            logits = engine.model(input_ids=logits.argmax(-1), cache=cache).logits[:, -1:]
    assert cache.report().fused_impl == {"native-cpu": cache.report().fused_calls}
    return torch.cat(out)


def test_kept_per_head_sides_give_the_logits_of_sides_rebuilt_every_step(engine64, monkeypatch):
    """A per-head layer's kernel sides are kept across decode steps (only the dense chunks, the row counts and,
    when rows were packed, the payload fields are set on them): the logits are those of sides rebuilt every step,
    bit for bit, across steps that pack a 32-token KIVI block and steps that pack nothing."""
    if not _native_ok():
        pytest.skip("no native kernel here")
    from tqbench.engine.cache.fused import native_glue

    monkeypatch.setenv("TQBENCH_FUSED_IMPL", "native")
    ids = engine64.encode_prompt(PROMPT, chat=False)
    kept = native_glue._kept_sides
    hits = []

    def counting(*args):
        out = kept(*args)
        hits.append(out is not None)
        return out

    monkeypatch.setattr(native_glue, "_kept_sides", counting)
    got = _decode_logits(engine64, NATIVE_POLICY, ids, 40)
    assert sum(hits) > len(hits) // 2  # the kept sides served most calls
    monkeypatch.setattr(native_glue, "_kept_sides", lambda *args: None)
    want = _decode_logits(engine64, NATIVE_POLICY, ids, 40)
    assert torch.equal(got, want)
