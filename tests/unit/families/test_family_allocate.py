"""``allocate`` on every model family (issue 30, item 3), sliding-window families first: Gemma-2/3 and gpt-oss
alternate sliding and full layers (the sliding ones bypassed: transformers' own window, no codec, no choice),
Mistral and Phi-3 slide on every layer (compressed in window-bounded stores). Window 8; every length here is past it.

The chunk runner (the allocation's measure) is checked against the model itself in float64: its exact chunk is the
full forward's continuation, running from a middle layer reproduces running all layers bit for bit, a chunk over a
quantized full-attention layer equals the same chunk fed to a real ``TQCache`` after the same prefill, and a chunk
over a compressed sliding layer equals teacher-forced decoding of the chunk one token at a time through a real
``TQCache`` (on a window the chunk's own rows are most of what a query reads, packed as they age).
"""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch
from transformers import DynamicCache

from tests.unit.families.short_windows import short_window_model
from tqbench.engine.allocate import allocate_policy
from tqbench.engine.allocate.chunk import ChunkRunner
from tqbench.engine.allocate.sensitivity import allocatable_layers
from tqbench.engine.allocate.solver import budget_bytes, choice_policy, solve_allocation, unit_bytes
from tqbench.engine.cache.estimate import estimate_kv
from tqbench.engine.engine import Engine
from tqbench.engine.models.families import FAMILIES, family_model
from tqbench.engine.policy import parse_policy

SLIDING = ("gemma2", "gemma3_text", "gpt_oss", "mistral", "phi3")
MIXED = ("gemma2", "gemma3_text", "gpt_oss")  # sliding + full layers: sliding=auto compresses the sliding ones too
WINDOW = 8
PREFILL, STEPS = 24, 6  # both past the window
BASE = "sink=2,recent=2,rotation=hadamard"  # recent below the window, so sliding stores pack rows too


@functools.cache
def engine(family: str, **overrides) -> Engine:
    return Engine(short_window_model(family, dtype=torch.float64, **overrides))


def _ids(batch=2, n=PREFILL + STEPS, seed=0):
    return torch.randint(3, 300, (batch, n), generator=torch.Generator().manual_seed(seed))


@functools.cache
def runner(family: str) -> ChunkRunner:
    return ChunkRunner(engine(family), _ids(), PREFILL)


@pytest.mark.parametrize("family", SLIDING + ("llama",))
def test_the_exact_chunk_is_the_full_forward_continuation(family):
    r, eng, ids = runner(family), engine(family), _ids()
    with torch.inference_mode():
        full = torch.log_softmax(eng.model(ids).logits, -1)[:, PREFILL:]
        cache = DynamicCache(config=eng.config)
        eng.model(ids[:, :PREFILL], cache=cache)
        continued = torch.log_softmax(eng.model(ids[:, PREFILL:], cache=cache).logits, -1)
    assert r.base_lp.dtype == torch.float64
    assert torch.equal(r.base_lp, continued)  # transformers' own prefill + chunk, to the bit
    # Gemma-2's eager attention takes its softmax in float32: one call and two differ by float32 rounding there
    assert (r.base_lp - full).abs().max().item() <= (1e-5 if family == "gemma2" else 1e-12)
    g = eng.geometry
    expected = [WINDOW - 1 if t == "sliding_attention" else None for t in g.layer_types] if g.layer_types else [None] * 4
    assert r.windows == expected
    assert [k.shape[2] for k in r.keys] == [PREFILL] * 4  # every prefill row, sliding layers included


@pytest.mark.parametrize("family", SLIDING)
def test_layer_skipping_reproduces_all_layers_bit_for_bit(family):
    r = runner(family)
    assert r.layer_skipping, r.skip_note
    pol = parse_policy(BASE + ",sliding=compress")
    for layer in range(4):
        for role in ("k", "v"):
            ks, vs = r.cell(pol, layer, {(role, None): "turbo2"})
            skipped, full = r.logprobs(ks, vs, start=layer), r.logprobs(ks, vs, start=0)
            assert torch.equal(skipped, full), (layer, role)
            assert r.kl(ks, vs, start=layer) > 1e-9, (layer, role)  # the quantized rows were read
    assert r.kl(r.keys, r.values, start=2) == 0.0


def _decoded(eng: Engine, pol, ids: torch.Tensor, prefill: int) -> torch.Tensor:
    """Log-probs of ``ids[:, prefill:]`` teacher-forced one token at a time through a real compressed ``TQCache``."""
    cache = eng.make_cache(pol, "compressed")
    out = []
    with torch.inference_mode():
        eng.model(input_ids=ids[:, :prefill], cache=cache, use_cache=True)
        for i in range(prefill, ids.shape[1]):
            out.append(torch.log_softmax(eng.model(input_ids=ids[:, i:i + 1], cache=cache).logits, -1))
    return torch.cat(out, 1)


@pytest.mark.parametrize("family,layer", [("gemma3_text", 1), ("llama", 0), ("llama", 1)])
def test_a_full_layer_cell_equals_the_chunk_through_a_real_cache(family, layer):
    """One full-attention layer's K at turbo2: the runner's chunk log-probs equal feeding the chunk in one call to a
    ``TQCache`` prefilled with the same tokens (the prefill history packed, the chunk's own rows exact)."""
    r, eng = runner(family), engine(family)
    pol = parse_policy(f"{BASE},k@{layer}=turbo2")
    ks, vs = r.cell(pol, layer, {("k", None): "turbo2"})
    cache = eng.make_cache(pol, "compressed")
    ids = _ids()
    with torch.inference_mode():
        eng.model(input_ids=ids[:, :PREFILL], cache=cache, use_cache=True)
        real = torch.log_softmax(eng.model(input_ids=ids[:, PREFILL:], cache=cache, use_cache=True).logits, -1)
    assert (r.logprobs(ks, vs, start=layer) - real).abs().max().item() <= 1e-12
    assert r.kl(ks, vs, start=layer) > 1e-9


@pytest.mark.parametrize("family,layer", [("gemma3_text", 0), ("gemma3_text", 2), ("mistral", 1), ("gpt_oss", 0),
                                          ("gemma2", 2)])
@pytest.mark.parametrize("specs", [{("k", None): "turbo2"}, {("v", 1): "turbo1", ("k", 0): "turbo3"}])
def test_a_sliding_layer_cell_equals_decoding_one_token_at_a_time(family, layer, specs):
    """A compressed sliding layer (window 8, recent 2: the chunk's rows pack as they age): the runner's one chunk
    call gives every query what teacher-forced decoding one token at a time through a real ``TQCache`` gives."""
    r, eng = runner(family), engine(family)
    base = parse_policy(f"{BASE},sliding=compress")
    ks, vs = r.cell(base, layer, specs)
    cand = ks[layer]
    pol = parse_policy(f"{BASE},sliding=compress,k@{layer}={cand.k},v@{layer}={cand.v}")
    real = _decoded(eng, pol, _ids(), PREFILL)
    cell = r.logprobs(ks, vs, start=layer)
    assert (cell - real).abs().max().item() <= (1e-5 if family == "gemma2" else 1e-12)  # (Gemma-2: see above)
    assert torch.equal(cell, r.logprobs(ks, vs, start=0))
    assert r.kl(ks, vs, start=layer) > 1e-9
    with pytest.raises(ValueError, match="sliding-window layer: its candidate is a sliding_candidate"):
        r.quantized(base, "turbo2", "k", layer)


def test_bypassed_sliding_layers_get_no_choice_and_exact_bytes():
    eng = engine("gemma3_text")
    g, base = eng.geometry, parse_policy(BASE)
    assert allocatable_layers(base, g) == [0, 1, 2, 3]  # sliding=auto compresses a mixed model's windows too
    assert allocatable_layers(replace(base, sliding="bypass"), g) == [1, 3]  # bypass: layers 0 and 2 stay dense
    assert allocatable_layers(replace(base, sliding="compress"), g) == [0, 1, 2, 3]
    assert allocatable_layers(replace(base, sliding="dense"), g) == [1, 3]
    assert allocatable_layers(replace(base, sliding="bypass", bypass="global"), g) == []
    with pytest.raises(ValueError, match="keeps every layer dense .* use sliding=compress"):
        allocate_policy(eng, 4.0, calib_prefill=PREFILL, calib_steps=4, base=BASE + ",sliding=bypass,bypass=global", context=64,
                        protections=[], max_measurements=0, verify_text=None, unseen_text=None)
    # the budget is bits per element of what an fp16 cache holds (a sliding layer: its window), as estimate_kv
    for ctx in (5, 64, 300):
        fp16 = estimate_kv(replace(base, k="fp16", v="fp16"), g, ctx)
        assert budget_bytes(g, 16.0, ctx, base) == fp16.total_bytes == fp16.dense_fp16_bytes


@pytest.mark.parametrize("sliding", ["auto", "compress", "dense"])
def test_the_solver_counts_every_layer_exactly_on_a_mixed_model(sliding):
    """Units' bytes + the layers without choices = estimate_kv of the solved policy, to the byte."""
    eng = engine("gemma3_text")
    g, base = eng.geometry, parse_policy(f"{BASE},sliding={sliding}")
    r = runner("gemma3_text")
    from tqbench.engine.allocate import measure_sensitivity

    table = measure_sensitivity(eng, r.ids, PREFILL, ["turbo1", "turbo3"], base, granularity="head", runner=r)
    assert table.layers == allocatable_layers(base, g)
    for ctx in (6, 64):
        ub = unit_bytes(table, base, g, ctx)
        for spec in ("turbo1", "turbo3"):
            choice = {u: spec for u in table.units()}
            est = estimate_kv(choice_policy(choice, base, g), g, ctx)
            fixed = sum(b for i, b in enumerate(est.layer_bytes) if i not in table.layers)
            assert sum(ub[u][spec] for u in choice) + fixed + est.shared_bytes == est.total_bytes, (ctx, spec)
        alloc = solve_allocation(table, g, 5.0, 64, base)
        assert alloc.estimate.total_bytes <= budget_bytes(g, 5.0, 64, base)
        assert alloc.bits_per_element <= 5.0


def _midway_budget(eng: Engine, base: str, context: int) -> float:
    """Halfway between every allocatable unit at turbo1 and at turbo3 (so the solver has a real choice)."""
    g, pol = eng.geometry, parse_policy(base)
    units = [(layer, role, h) for layer in allocatable_layers(pol, g) for role in "kv" for h in range(g.kv_heads)]
    lo, hi = (estimate_kv(choice_policy({u: s for u in units}, pol, g), g, context).bits_per_element
              for s in ("turbo1", "turbo3"))
    return round((lo + hi) / 2, 3)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_allocate_by_head_runs_on_every_family(family):
    eng = engine(family)
    context = 64
    budget = _midway_budget(eng, BASE, context)
    rep = allocate_policy(eng, budget, calib_prefill=PREFILL, calib_steps=4, codecs=["turbo1", "turbo3"],
                          granularity="head", base=BASE, context=context, protections=[], max_measurements=2,
                          verify_prefill=PREFILL, verify_steps=4)
    a, g = rep.allocation, eng.geometry
    assert rep.table.layers == allocatable_layers(parse_policy(BASE), g)
    if family in MIXED:
        assert rep.table.layers == list(range(g.num_layers))  # sliding=auto: the windows are offered codecs too
    assert rep.table.heads == list(range(g.kv_heads))
    assert a.bits_per_element <= budget
    assert a.estimate.total_bytes == estimate_kv(a.policy, g, context).total_bytes
    assert rep.verified.report_bytes == a.estimate.total_bytes  # the cache's own report after `context` tokens
    assert rep.measured_kl is not None and 0 < rep.measured_kl < 1
    assert 0 < rep.verified.kl_mean < 1 and 0 < rep.unseen.kl_mean < 1
    # layer skipping everywhere but Falcon (its decoder has no layer list: every cell runs all layers, and says so)
    assert any("every cell runs all layers" in n for n in rep.notes) == (family == "falcon"), rep.notes


def test_an_all_sliding_model_below_its_floor_says_why():
    """tiny-mistral: four 7-row windows; recent=16 keeps every row fp16, so no budget under 16 bits fits."""
    eng = engine("mistral")
    with pytest.raises(ValueError, match=r"needs about 16.000 bits/element \(4 of its layers are sliding windows "
                                         r"holding 7 rows, all of which recent=16 keeps fp16"):
        allocate_policy(eng, 2.5, calib_prefill=PREFILL, calib_steps=4, base="sink=4,recent=16", context=1024,
                        protections=[], max_measurements=0, verify_text=None, unseen_text=None)


# -- a Gemma-3-shaped model: five sliding layers to one global, one KV head, head_dim 256 ----------------------------
GEMMA3_SHAPE = dict(num_hidden_layers=6, layer_types=["sliding_attention"] * 5 + ["full_attention"],
                    num_key_value_heads=1, head_dim=256, num_attention_heads=4, sliding_window=16)


@functools.cache
def gemma3_shaped() -> Engine:
    return Engine(family_model("gemma3_text", dtype=torch.float64, **GEMMA3_SHAPE))


@pytest.mark.parametrize("granularity", ["layer", "head"])
@pytest.mark.parametrize("sliding", ["bypass", "compress"])
def test_one_kv_head_head_dim_256_allocates_past_the_window(sliding, granularity):
    """calibration and verification prefills of 48 tokens past a 16-token window, per layer or per KV head (one
    head: the layer), the sliding layers bypassed (only the global layer is chosen) or compressed."""
    eng = gemma3_shaped()
    base = f"sink=2,recent=4,rotation=hadamard,sliding={sliding}"
    rep = allocate_policy(eng, 9.0, calib_prefill=48, calib_steps=8, codecs=["turbo1", "turbo3"],
                          granularity=granularity,
                          base=base, context=128, protections=[], max_measurements=2, verify_prefill=48,
                          verify_steps=8)
    a = rep.allocation
    assert rep.table.layers == ([5] if sliding == "bypass" else list(range(6)))
    assert rep.table.heads == ([0] if granularity == "head" else None)
    assert a.bits_per_element <= 9.0 and rep.verified.report_bytes == a.estimate.total_bytes
    assert 0 < rep.measured_kl < 1 and 0 < rep.verified.kl_mean < 1
    assert not any("every cell runs all layers" in n for n in rep.notes)


def test_a_1024_token_calibration_past_a_512_token_window():
    """The reported failure's shape: a 1024-token calibration prefill on a model with one KV head, head_dim 256 and
    a 512-token window, five sliding layers to one global, compressed (float32, as the CLI runs it)."""
    eng = Engine(family_model("gemma3_text", **{**GEMMA3_SHAPE, "sliding_window": 512,
                                                "max_position_embeddings": 4096}))
    rep = allocate_policy(eng, 4.0, calib_prefill=1024, calib_steps=8, codecs=["turbo1", "turbo2", "turbo4"],
                          granularity="head", base="sink=4,recent=16,sliding=compress", context=2048, protections=[],
                          max_measurements=1, verify_prefill=1024, verify_steps=4, unseen_text=None)
    a = rep.allocation
    assert rep.table.layers == list(range(6)) and a.bits_per_element <= 4.0
    assert rep.verified.report_bytes == a.estimate.total_bytes
    assert 0 < rep.measured_kl < 1 and 0 < rep.verified.kl_mean < 1
    # bypassed (sliding=bypass), the five 511-row fp16 windows are most of the cache: the refusal says so; and a
    # table offering the bypassed layers is refused rather than solved
    bypass = parse_policy("sink=4,recent=16,sliding=bypass")
    table = replace(rep.table, layers=[5], kl={u: row for u, row in rep.table.kl.items() if u[0] == 5})
    with pytest.raises(ValueError, match=r"5 layers keep fp16 without a choice \(sliding-window layers bypassed or "
                                         r"dense: 56% of the fp16 cache"):
        solve_allocation(table, eng.geometry, 4.0, 2048, bypass)
    with pytest.raises(ValueError, match=r"offers choices for layers \[0, 1, 2, 3, 4\], which .* keeps dense"):
        solve_allocation(rep.table, eng.geometry, 4.0, 2048, bypass)


def test_one_kv_head_head_dim_256_cells_equal_the_real_cache():
    eng = gemma3_shaped()
    ids = torch.randint(3, 300, (1, 56), generator=torch.Generator().manual_seed(1))
    r = ChunkRunner(eng, ids, 48)
    assert r.layer_skipping and r.windows == [15] * 5 + [None]
    base = parse_policy("sink=2,recent=4,rotation=hadamard,sliding=compress")
    ks, vs = r.cell(base, 2, {("k", None): "turbo2", ("v", None): "turbo1"})  # sliding: decoded one at a time
    real = _decoded(eng, parse_policy(f"{base.to_string()},k@2=turbo2,v@2=turbo1"), ids, 48)
    assert (r.logprobs(ks, vs, start=2) - real).abs().max().item() <= 1e-12
    assert torch.equal(r.logprobs(ks, vs, start=2), r.logprobs(ks, vs, start=0))
    ks, vs = r.cell(base, 5, {("v", 0): "turbo2"})  # the global layer: one chunk call over the packed prefill
    cache = eng.make_cache(parse_policy(f"{base.to_string()},v@5=turbo2"), "compressed")
    with torch.inference_mode():
        eng.model(input_ids=ids[:, :48], cache=cache, use_cache=True)
        real = torch.log_softmax(eng.model(input_ids=ids[:, 48:], cache=cache, use_cache=True).logits, -1)
    assert (r.logprobs(ks, vs, start=5) - real).abs().max().item() <= 1e-12


def test_calibrated_keys_on_compressed_sliding_layers(tmp_path):
    """A pcaq fit of tiny-gemma3_text (its own), offered per KV head on every layer, the sliding ones in
    window-bounded stores: the bytes stay exact and a calibrated key codec is measured on every layer."""
    from tqbench.engine.calibrate.transforms import fit_transforms
    from tqbench.engine.codecs.transforms_file import save_transforms

    eng = engine("gemma3_text")
    path = save_transforms(fit_transforms(eng, ["prose", "code"], max_tokens=64), tmp_path / "g3.safetensors")
    base = f"sink=2,recent=2,rotation=hadamard,sliding=compress,calib={path}"
    rep = allocate_policy(eng, 6.0, calib_prefill=PREFILL, calib_steps=4, codecs=["turbo1", "turbo3"],
                          granularity="head", base=base, context=64, protections=[], max_measurements=2,
                          verify_prefill=PREFILL, verify_steps=4)
    assert rep.setup["k_codecs"] == ["turbo1", "turbo3", "pcaq2", "pcaq3", "pcaq4"]
    assert rep.table.layers == [0, 1, 2, 3]
    for layer in range(4):
        for h in range(2):
            assert 0 < rep.table.get(layer, "k", "pcaq2", h) < 1, (layer, h)
    a = rep.allocation
    assert a.bits_per_element <= 6.0 and rep.verified.report_bytes == a.estimate.total_bytes
    assert a.estimate.total_bytes == estimate_kv(a.policy, eng.geometry, 64).total_bytes


# -- scan and calibrate on sliding models -----------------------------------------------------------------------------
def test_scan_scores_sliding_layers_under_their_window():
    from tqbench.engine.scan import head_metrics
    from tqbench.engine.scan.capture import capture_qkv
    from tqbench.engine.scan.metrics import roundtrip
    from tqbench.engine.scan.run import scan, sliding_windows

    eng = engine("gemma3_text")
    assert sliding_windows(eng.geometry) == {0: WINDOW, 2: WINDOW}
    assert sliding_windows(engine("llama").geometry) == {}
    ids = _ids(1, 40)
    cap = capture_qkv(eng, ids, None, 40)
    res = scan(eng, ids, codecs=["turbo2"], capture=cap)
    for layer in range(4):
        d = cap.layers[layer]
        kq, vq = roundtrip("turbo2", "k", d.k, layer=layer), roundtrip("turbo2", "v", d.v, layer=layer)
        window = WINDOW if layer in (0, 2) else None
        want = [round(head_metrics(d.q[2 * h:2 * h + 2], d.k[h], d.v[h], kq[h], vq[h], d.scaling, window)
                      ["softmax_kl"], 7) for h in range(2)]
        assert res.metrics["softmax_kl"]["turbo2"][layer] == want, layer
    # the window mask: query t reads keys t - 7 .. t (transformers' sliding_window_overlay: kv > q - window)
    from tqbench.engine.scan.metrics import _causal_scores

    d = cap.layers[0]
    finite = torch.isfinite(_causal_scores(d.q[:1], d.k[0], d.scaling, WINDOW)[0])
    t = torch.arange(40)
    assert torch.equal(finite, (t[None, :] <= t[:, None]) & (t[None, :] > t[:, None] - WINDOW))
    assert torch.isfinite(_causal_scores(d.q[:1], d.k[0], d.scaling)[0]).sum() == 40 * 41 // 2


def test_calibrate_truncates_long_texts_before_the_context_check():
    """tiny-gemma3_text has a 512-token context and the calibration texts are longer: the fit reads the first
    ``max_tokens`` of each (the check applies to what is kept)."""
    from tqbench.engine.calibrate.transforms import fit_transforms
    from tqbench.engine.request import PromptTooLongError
    from tqbench.engine.scan.capture import capture_qkv

    eng = engine("gemma3_text")
    tr = fit_transforms(eng, ["prose", "code"], max_tokens=40)
    assert (tr.num_layers, tr.kv_heads, tr.head_dim) == (4, 2, 32)
    assert [c["tokens"] for c in tr.calibration] == [40, 40]
    with pytest.raises(PromptTooLongError):
        capture_qkv(eng, "word " * 600, None, 600, chat=False)


# -- the CLI --------------------------------------------------------------------------------------------------------
def _cli(*args):
    from click.testing import CliRunner

    from tqbench.cli.group import main

    return CliRunner().invoke(main, ["--headless", "allocate", *args])


CLI_SMALL = ["--calib-prefill", "24", "--calib-steps", "4", "--verify-prefill", "24", "--verify-steps", "4",
             "--context", "64", "--sink", "2", "--recent", "2", "--sinks", "", "--codecs", "turbo1,turbo3",
             "--max-measurements", "1", "--granularity", "head", "--json"]


@pytest.mark.parametrize("model", ["tiny-gemma3_text", "tiny-mistral"])
def test_cli_allocate_with_a_base_that_compresses_sliding_layers(model):
    import json

    res = _cli("--model", model, "--budget", "8", "--base", "rotation=hadamard,sliding=compress", *CLI_SMALL)
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert "sliding=compress" in data["allocation"]["kv_policy_string"]
    assert "rotation=hadamard" in data["allocation"]["kv_policy_string"]
    assert data["allocation"]["bits_per_element"] <= 8
    assert data["verified"]["report_bytes"] == data["allocation"]["total_bytes"]
    assert data["fitted_vs_unseen"]["calibration_joint_kl"] > 0 and data["verified"]["kl_mean"] > 0
    assert data["setup"]["codec_options"].endswith("sliding=compress,rotation=hadamard")


@pytest.mark.parametrize("base", ["turbo4", "k=turbo2", "sink=8", "protect=first2", "k@0=turbo1"])
def test_cli_allocate_base_takes_no_codecs_or_protection(base):
    res = _cli("--model", "tiny-gemma3_text", "--budget", "6", "--base", base, *CLI_SMALL)
    assert res.exit_code == 2, res.output
    assert f"--base {base!r} must hold codec options and the layer plan only" in res.stderr
    assert "Traceback" not in res.output


def test_the_default_protection_grid_follows_the_layers():
    """recent=0 joins the grid where sliding layers are compressed; an all-sliding model searches no sinks."""
    from tqbench.engine.allocate.exchange import RECENT_GRID, SINK_GRID, SRECENT_GRID, protection_grid

    base = parse_policy("sink=4,recent=16")
    full = [(s, r) for s in SINK_GRID for r in RECENT_GRID]
    assert protection_grid(base, engine("llama").geometry) == full
    # a mixed model: the sliding layers' own recent rows too, at the base's sink and recent
    assert protection_grid(base, engine("gemma3_text").geometry) == [(s, r) for s in SINK_GRID for r in (*RECENT_GRID, 0)] \
        + [(4, 16, sr) for sr in SRECENT_GRID]
    assert protection_grid(replace(base, sliding="bypass"), engine("gemma3_text").geometry) == full
    assert protection_grid(base, engine("mistral").geometry) == [(4, r) for r in (*RECENT_GRID, 0)]


@pytest.mark.parametrize("model", ["tiny-gemma3_text", "tiny-mistral"])
def test_the_issue_must_show_allocates_2_5_bits_past_the_window(model):
    """issue 30's must-show, verbatim: 256-token calibration and verification past the window (tiny-mistral: 192 on
    every layer; only recent=0 fits 2.5 bits there), measured KL, the cache's own bytes equal to the estimate."""
    import json

    from tqbench.engine.models.families import FAMILIES

    res = _cli("--model", model, "--budget", "2.5", "--granularity", "head", "--calib-prefill", "256",
               "--verify-prefill", "256", "--verify-steps", "16", "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    a = data["allocation"]
    assert FAMILIES[model.removeprefix("tiny-")]["sliding_window"] < 256
    assert a["bits_per_element"] <= 2.5
    assert data["verified"]["report_bytes"] == a["total_bytes"]
    assert 0 < data["fitted_vs_unseen"]["calibration_joint_kl"] < 1
    assert 0 < data["verified"]["kl_mean"] < 1 and 0 < data["unseen"]["kl_mean"] < 1
    measured = [s for s in data["steps"] if s["measured_kl"] is not None]
    assert measured and all(s["total_bytes"] > 0 for s in measured)
    if model == "tiny-mistral":
        assert {(s["sink"], s["recent"]) for s in measured if s["kind"] == "protection"} == {(4, 0)}
        assert "recent" not in a["kv_policy_string"]  # recent=0: the default, not written


def test_grouped_sdpa_switches_one_model_for_the_block_only():
    """The chunk forwards' grouped-query SDPA (no ``repeat_kv`` copy): the model's own configs are switched and
    restored, nothing process-wide is set, another model is untouched, and the log-probs are the model's own."""
    import os

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from tqbench.engine.allocate.gqa import GQA_NAME, grouped_sdpa, grouped_sdpa_forward
    from tqbench.engine.cache.fused.support import recorded_previous

    eng, other = Engine(family_model("llama", dtype=torch.float64)), engine("qwen2")
    assert eng.config._attn_implementation == "sdpa" == other.config._attn_implementation
    ids = _ids()
    with torch.inference_mode():
        plain = eng.model(ids).logits
        with grouped_sdpa(eng.model, torch.device("cpu")):
            assert eng.config._attn_implementation == GQA_NAME
            assert ALL_ATTENTION_FUNCTIONS[GQA_NAME] is grouped_sdpa_forward
            assert other.config._attn_implementation == "sdpa"
            assert "TRANSFORMERS_SDPA_FORCE_GQA" not in os.environ
            grouped = eng.model(ids).logits
        assert eng.config._attn_implementation == "sdpa"
        assert (grouped - plain).abs().max().item() <= 1e-12
        eng.enable_fused()  # fused installed: its plain-tensor route is switched instead, then restored
        with grouped_sdpa(eng.model, torch.device("cpu")):
            assert eng.config._attn_implementation == "tqbench_fused" and recorded_previous(eng.config) == GQA_NAME
            assert torch.equal(eng.model(ids).logits, grouped)
        assert recorded_previous(eng.config) == "sdpa"
        with grouped_sdpa(eng.model, "cuda"):  # off the CPU: nothing switched
            assert recorded_previous(eng.config) == "sdpa"


def test_srecent_gives_the_sliding_layers_their_own_recent_rows_to_the_byte():
    """``srecent``: the fp16 recent rows of the compressed sliding-window layers, ``recent`` the full layers'; the
    plan, the estimate and a real cache's report agree to the byte, and the compact form reads back equal."""
    eng = engine("gemma3_text")
    g = eng.geometry
    pol = parse_policy(f"k=turbo2,v=turbo1,{BASE.replace('recent=2', 'recent=1')},srecent=4")
    assert parse_policy(pol.to_string()) == pol and "srecent=4" in pol.to_string()
    plans = pol.plan(g.num_layers, list(g.layer_types))
    assert {(p.sliding, p.sink, p.recent) for p in plans} == {(True, 0, 4), (False, 2, 1)}
    same = replace(pol, srecent=-1)
    assert "srecent" not in same.to_string()
    assert [p.recent for p in same.plan(g.num_layers, list(g.layer_types))] == [1] * g.num_layers
    cache = eng.make_cache(pol, "compressed")
    with torch.inference_mode():
        eng.model(input_ids=_ids(batch=1, n=PREFILL), cache=cache, use_cache=True)
    rep = cache.report()
    est = estimate_kv(pol, g, PREFILL)
    assert rep.compressed_storage_bytes == est.total_bytes
    assert est.total_bytes > estimate_kv(same, g, PREFILL).total_bytes  # 3 more fp16 rows per sliding layer
    with pytest.raises(ValueError, match="srecent=-2 is invalid"):
        replace(pol, srecent=-2)


def test_sliding_repricer_re_measures_the_sliding_layers_cells_at_an_srecent_option_only():
    """On a model mixing sliding and full layers: the sliding layers' cells at the option's own recent rows (as
    ``measure_sensitivity`` measures them there), the full layers' kept; stored under ``@sr<rows>`` keys, so a
    second call measures nothing; None at the base's rows and on a model without sliding layers."""
    from tqbench.engine.allocate.sensitivity import measure_sensitivity, sliding_repricer

    base = parse_policy(BASE)
    r = runner("gemma3_text")
    codecs = ["turbo1", "turbo2"]
    table = measure_sensitivity(engine("gemma3_text"), r.ids, PREFILL, codecs, base, runner=r)
    known, stored = {}, []
    reprice = sliding_repricer(engine("gemma3_text"), r, table, base, codecs, None, "layer", known,
                               lambda k, kl: stored.append(k))
    assert reprice(replace(base, srecent=2)) is None  # the base's rows (recent=2)
    opt = replace(base, srecent=6)
    own = reprice(opt)
    slides = [layer for layer in table.layers if r.windows[layer] is not None]
    full = [layer for layer in table.layers if r.windows[layer] is None]
    assert slides and full
    for layer in full:
        assert own.kl[(layer, "k")] == table.kl[(layer, "k")] and own.kl[(layer, "v")] == table.kl[(layer, "v")]
    direct = measure_sensitivity(engine("gemma3_text"), r.ids, PREFILL, codecs, opt, runner=r)
    for layer in slides:
        assert own.kl[(layer, "k")] == direct.kl[(layer, "k")]
        assert own.kl[(layer, "k")] != table.kl[(layer, "k")]
    assert sorted(stored) == sorted(f"{layer}/{role}/{c}@sr6" for layer in slides for role in "kv" for c in codecs)
    assert reprice.measured == len(stored)
    again = reprice(opt)
    assert again.kl == own.kl and reprice.measured == len(stored)  # all resumed from known
    llama = runner("llama")
    t2 = measure_sensitivity(engine("llama"), llama.ids, PREFILL, codecs, base, runner=llama)
    assert sliding_repricer(engine("llama"), llama, t2, base, codecs, None, "layer", {}) is None
