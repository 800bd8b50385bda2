"""Rules written once: bits per element, "every fused call ran in a kernel", atomic file writes, no CLI flag in an
engine message, the dense fp16 bytes, a sliding layer's window - 1 rows, codec names, the fused kernels' mask."""

from __future__ import annotations

import json
import os

import pytest

from tqbench.engine.cache import TQCache, estimate_kv
from tqbench.engine.cache.report import bits_vs_fp16, ran_in_kernels
from tqbench.engine.codecs import codec_from_spec
from tqbench.engine.codecs.base import bits_per_element


def test_bits_per_element_by_hand():
    # turbo4 at head_dim 128: 128 x 4-bit indices (64 bytes) + a 2-byte fp16 norm per row
    assert codec_from_spec("turbo4", "k").bits_per_element(128) == bits_per_element(66, 128) == 66 * 8 / 128
    assert bits_vs_fp16(66, 128 * 2) == 4.125  # the same row against fp16's 2 bytes per element
    assert bits_per_element(10, 0) == 0.0


def test_every_report_uses_the_one_definition(tiny_engine):
    import torch

    cache = TQCache("turbo4", tiny_engine.config, "compressed")
    with torch.no_grad():
        tiny_engine.model(torch.arange(40).unsqueeze(0), cache=cache)
    rep = cache.report()
    assert rep.bits_per_element == round(bits_vs_fp16(rep.compressed_storage_bytes, rep.dense_fp16_bytes), 4)
    for layer in rep.layers:
        assert layer.bits_per_element == layer.total_bytes * 8 / (layer.dense_fp16_bytes / 2)
    est = estimate_kv("turbo4", tiny_engine.geometry, 40)
    assert est.bits_per_element == bits_vs_fp16(est.total_bytes, est.dense_fp16_bytes)


@pytest.mark.parametrize("impl, fallbacks, ran", [
    ({"native-cpu": 3}, {}, True),
    ({"triton": 2, "native-cpu": 1}, {}, True),
    ({"native-cpu": 1, "torch-reference (odd head_dim)": 1}, {}, False),
    ({"triton": 1}, {"mask": 1}, False),
    ({}, {}, False),  # no fused call yet
])
def test_ran_in_kernels(impl, fallbacks, ran):
    assert ran_in_kernels(impl, fallbacks) is ran


def test_cli_reports_are_written_atomically(tmp_path, monkeypatch):
    from tqbench.cli.options import write_reports

    target = tmp_path / "report.json"
    target.write_text('{"old": true}')

    def crash(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        write_reports({"new": 1}, None, str(target), None, as_json=False)
    assert json.loads(target.read_text()) == {"old": True}  # the old file is whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]  # no temp file left
    monkeypatch.undo()
    write_reports({"new": 1}, "# md\n", str(target), str(tmp_path / "r.md"), as_json=False)
    assert json.loads(target.read_text()) == {"new": 1} and (tmp_path / "r.md").read_text() == "# md\n"


# ---- no engine message names a CLI flag --------------------------------------------------------------------
#: flags the engine may name, with why: they belong to other programs, not to tqbench's CLI
FOREIGN_FLAGS = {
    "deploy/mapping.py": ({"--cache-type-k", "--cache-type-v", "--kv-cache-dtype", "--kv-cache-dtype-skip-layers",
                           "--model-path", "--extra_llm_api_options"}, "the deploy targets' own flags"),
    "codecs/engine_formats.py": ({"--kv-cache-dtype"}, "vLLM's and SGLang's flag that selects the format"),
    "models/resolve.py": ({"--no-deps", "--force-reinstall"}, "pip's flags in an install hint"),
    "models/named.py": ({"--no-deps"}, "pip's flag in an install hint"),
    "deploy/llamacpp.py": ({"--build", "--target", "--install", "--no-repack", "--repack"},
                           "cmake's flags, xcode-select's in a hint, llama.cpp tools' own flags"),
    "deploy/llamacpp_kld.py": ({"--kl-divergence", "--kl-divergence-base", "--chunks"},
                               "llama-perplexity's own flags"),
    "deploy/llamacpp_verify.py": ({"--kl-divergence", "--chunks"}, "llama-perplexity's own flags, in the protocol line"),
}


def _engine_strings():
    """(file relative to the engine, line, text) of every string literal in the engine but docstrings."""
    import ast
    from pathlib import Path

    import tqbench.engine

    root = Path(tqbench.engine.__file__).parent
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docs = {id(n.body[0].value) for n in ast.walk(tree)
                if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
                and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
                yield path.relative_to(root).as_posix(), node.lineno, node.value


def test_no_engine_message_names_a_cli_flag():
    import re

    found = []
    for rel, line, text in _engine_strings():
        allowed = FOREIGN_FLAGS.get(rel, (set(), ""))[0]
        found += [f"{rel}:{line}: {flag}" for flag in re.findall(r"(?<![\w-])--[a-z][\w-]*", text)
                  if flag not in allowed]
    assert not found, "engine messages name CLI flags (name the field; the CLI spells it):\n" + "\n".join(found)


def test_the_scan_reads_f_strings_and_not_docstrings():
    texts = {(rel, text) for rel, _, text in _engine_strings()}
    assert ("request.py", " is invalid: ") in texts  # a literal part of an f-string
    assert not any(text.startswith("What a front end asks") for rel, text in texts if rel == "request.py")


def test_the_cli_spells_an_engine_field_as_its_flag():
    from click.testing import CliRunner

    from tqbench.cli.group import main

    r = CliRunner().invoke(main, ["--headless", "kv-estimate", "--seq-len", "0"])
    assert r.exit_code == 2 and "error: --seq-len=0 is invalid: use at least 1 token" in r.stderr
    from tqbench.engine.cache import kv_estimate, model_geometry
    from tqbench.engine.request import RequestError

    with pytest.raises(RequestError, match=r"^seq_len=0 is invalid: use at least 1 token$"):
        kv_estimate(model_geometry("default"), ["fp16"], 0)


# ---- the dense fp16 baseline: K rows and V rows, each its own width ----------------------------------------
def test_dense_fp16_bytes_counts_k_and_v_at_their_own_widths():
    from tqbench.engine.allocate.solver import budget_bytes, dense_elements
    from tqbench.engine.cache.geometry import KVGeometry, dense_fp16_bytes, fp16_row_bytes

    g = KVGeometry(4, 2, 32, v_head_dim=8)  # MLA-like: V rows narrower than K rows
    assert fp16_row_bytes(10, 32) == 10 * 32 * 2
    assert dense_fp16_bytes(10, 32, 8) == 10 * (32 + 8) * 2 and dense_fp16_bytes(10, 32) == 10 * 64 * 2
    assert g.dense_fp16_bytes(41) == 2 * 41 * (32 + 8) * 2 and g.dense_fp16_bytes(41, batch=3) == 3 * 2 * 41 * 40 * 2
    assert estimate_kv("q8k-int4v", g, 41).dense_fp16_bytes == 4 * g.dense_fp16_bytes(41)
    assert estimate_kv("q8k-int4v", g, 41, batch=2).dense_fp16_bytes == 4 * g.dense_fp16_bytes(41, batch=2)
    assert dense_elements(g, 41) == 4 * 2 * 41 * (32 + 8)
    assert budget_bytes(g, 16.0, 41) == 4 * g.dense_fp16_bytes(41)  # 16 bits per element is the fp16 cache


# ---- a sliding layer keeps window - 1 rows -----------------------------------------------------------------
def test_window_rows_is_the_one_sliding_rule(tiny_engine):
    from tqbench.engine.cache.geometry import KVGeometry, window_rows
    from tqbench.engine.cache.layer import TQLayer
    from tqbench.engine.policy import parse_policy

    assert window_rows(8) == 7 and window_rows(None) is None
    g = KVGeometry(2, 1, 16, ("sliding_attention", "full_attention"), 8)
    assert g.window_rows == 7 and g.window_held(5) == 5 and g.window_held(40) == 7
    assert KVGeometry(2, 1, 16).window_held(40) == 40
    pol = parse_policy("turbo4,sliding=compress")
    plans = pol.plan(2, ["sliding_attention", "full_attention"])
    assert [TQLayer(p, "compressed", pol, 8).window for p in plans] == [7, None]
    # the dense basis holds the window on the sliding layer (bypassed or compressed), everything on the full one
    for text in ("turbo4", "turbo4,sliding=compress"):
        assert estimate_kv(text, g, 40).dense_fp16_bytes == g.dense_fp16_bytes(7) + g.dense_fp16_bytes(40)


# ---- codec names are decoded by one parser ------------------------------------------------------------------
@pytest.mark.parametrize("spec, family, bits, cls", [
    ("fp16", "dense", 16, "DenseCodec"), ("bf16", "dense", 16, "DenseCodec"), ("fp32", "dense", 32, "DenseCodec"),
    ("int8", "affine", 8, "AffineTokenCodec"), ("int2", "affine", 2, "AffineTokenCodec"),
    ("turbo3", "turbo", 3, "TurboCodec"), ("turbo2.5", "turbo-split", 2.5, "TurboSplitCodec"),
    ("turbo4-qjl", "turbo-qjl", 4, "TurboProdCodec"), ("q4_0", "ggml", 4, "GgmlCodec"),
    ("q5_1", "ggml", 5, "GgmlCodec"), ("fp8_e5m2-prefill", "fp8", 8, "Fp8Codec"),
    ("fp4_mx_block16", "fp4", 4, "Fp4Block16Codec"), ("pcaq2.5", "pcaq", 2.5, "PcaKeyCodec"),
])
def test_one_codec_name_parser(spec, family, bits, cls):
    from tqbench.engine.codecs import nominal_bits, parse_codec_name

    n = parse_codec_name(spec)
    assert (n.spec, n.family, n.bits) == (spec, family, bits) and nominal_bits(spec) == bits
    if family != "pcaq":  # a calibrated codec loads its transforms file
        assert type(codec_from_spec(spec, "v")).__name__ == cls


def test_every_registered_codec_name_parses():
    from tqbench.engine.codecs import CODEC_SPECS, parse_codec_name
    from tqbench.engine.codecs.names import FAMILIES

    assert {parse_codec_name(s).family for s in CODEC_SPECS} == set(FAMILIES) - {"pcaq"}
    assert (parse_codec_name("fp8_e4m3").fmt, parse_codec_name("fp8_e4m3").scale) == ("e4m3", "static")
    for bad in ("turbox", "int", "turbo4-qjlx", "zstd"):
        with pytest.raises(ValueError, match="is not a codec name"):
            parse_codec_name(bad)


# ---- one attention-mask rule for both fused kernel paths ---------------------------------------------------
def _masks():
    import torch

    neg = torch.finfo(torch.float32).min
    want = torch.tensor([[[True, True, False, True]]])
    bias = torch.zeros(1, 1, 1, 4)
    bias[..., 2] = -0.5
    return want, {
        "bool": want[:, None].clone(),
        "-inf": torch.tensor([[[[0.0, 0.0, float("-inf"), 0.0]]]]),
        "finfo.min": torch.tensor([[[[0.0, 0.0, neg, 0.0]]]]),
        "bias": bias,
        "per-head": torch.zeros(1, 2, 1, 4),
    }


@pytest.mark.parametrize("path", ["native", "triton"])
def test_both_kernel_paths_read_a_mask_the_same_way(path):
    import torch

    if path == "native":
        from tqbench.engine.cache.fused.native_glue import bool_mask as read
    else:
        pytest.importorskip("triton")
        from tqbench.engine.cache.fused.triton_glue import kernel_mask

        def read(m, seq, total):
            return kernel_mask(m, seq, total, "cpu")

    want, masks = _masks()
    for name in ("bool", "-inf", "finfo.min"):
        assert torch.equal(read(masks[name], 1, 4), want), name
    assert read(masks["bias"], 1, 4) == "an additive attention bias (not a 0/-inf mask)"  # never read as "attend"
    assert read(masks["per-head"], 1, 4) == "per-head attention masks"
    assert read(None, 1, 4) is None  # one query row attends to every row
    if path == "triton":  # the Triton kernels take the causal mask spelled out
        assert read(None, 2, 4).tolist() == [[[True, True, True, False], [True, True, True, True]]]
    else:  # the native kernel applies it itself
        assert read(None, 2, 4) is None
