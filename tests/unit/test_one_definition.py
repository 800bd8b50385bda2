"""Rules written once: bits per element, "every fused call ran in a kernel", and atomic file writes."""

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
