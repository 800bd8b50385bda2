"""llama.cpp in the loop on the default model: ``export --to llamacpp --verify`` runs ``-ctk q8_0 -ctv q8_0`` in
llama.cpp's ``llama-perplexity`` and tqbench's prediction of its KLD lands within 2x of it, on a short text
(256-token chunks of heldout:code). Skipped, saying why, when llama.cpp is not built here (``tqbench --headless
llamacpp build`` builds it, several minutes; the test never builds)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from tqbench.cli import main
from tqbench.engine.deploy.llamacpp import find_llamacpp_tool

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(find_llamacpp_tool("llama-perplexity") is None,
                       reason="llama.cpp is not built here: run `tqbench --headless llamacpp build` (minutes, once)"),
]


def test_export_verify_q8_0_in_llamacpp_on_a_short_text():
    r = CliRunner().invoke(main, ["--headless", "export", "llamacpp:q8_0/q8_0", "--to", "llamacpp", "--verify",
                                  "--kld-ctx", "256", "--kld-text", "heldout:code", "--tf-context", "32",
                                  "--tf-tokens", "4", "--threads", "1", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    k = d["llamacpp_kld"]
    assert (k["k"], k["v"], k["n_ctx"]) == ("q8_0", "q8_0", 256)
    assert k["tokens_from"] == "llama.cpp's base file" and k["llamacpp"]["version"] == "11434.0.0"
    (row,) = k["rows"]
    assert row["text"] == "heldout:code" and row["scored_tokens"] == k["measured"][0]["tokens"]
    assert row["scored_tokens"] % 127 == 0  # 127 scored per 256-token chunk
    assert 0 < row["measured_kld"] < 0.05
    assert 0.5 <= row["predicted_over_measured"] <= 2.0, row
    assert any("activations" in line for line in k["differences"])
