"""llama.cpp in the loop on Gemma-3 270M (15 sliding layers of 512, one KV head of 256, a BOS before every chunk):
``export --to llamacpp --verify`` runs ``-ctk q4_0 -ctv q4_0`` in llama.cpp's ``llama-perplexity`` on one 640-token
chunk (past the 512-token window) and tqbench's prediction of its KLD lands within 25% of it. Skipped, saying why, when
llama.cpp is not built here (``tqbench --headless llamacpp build``, minutes; the test never builds) or the model
is not installed (``make gemma``). 1-5 minutes (model load, two 640-token forwards, two llama.cpp runs): the only
check of the Gemma-3 prediction against llama.cpp in the suite."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from tqbench.cli import main
from tqbench.engine.deploy.llamacpp import find_llamacpp_tool
from tqbench.engine.models import ModelNotFoundError, resolve_model

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(find_llamacpp_tool("llama-perplexity") is None,
                       reason="llama.cpp is not built here: run `tqbench --headless llamacpp build` (minutes, once)"),
]


def test_export_verify_q4_0_in_llamacpp_on_gemma3():
    try:
        resolve_model("gemma3-270m")
    except ModelNotFoundError as exc:
        pytest.skip(str(exc))
    r = CliRunner().invoke(main, ["--headless", "export", "llamacpp:q4_0/q4_0", "--to", "llamacpp", "--verify",
                                  "--model", "gemma3-270m", "--kld-ctx", "640", "--kld-text", "heldout:technical",
                                  "--kld-chunks", "1", "--tf-context", "32", "--tf-tokens", "4", "--threads", "1",
                                  "--json"])
    assert r.exit_code == 0, r.output
    k = json.loads(r.stdout)["llamacpp_kld"]
    assert (k["k"], k["v"], k["n_ctx"], k["tokens_from"]) == ("q4_0", "q4_0", 640, "llama.cpp's base file")
    (row,) = k["rows"]
    assert row["scored_tokens"] == 319  # positions 320..638 of the one chunk, 127 of them read past the window
    assert 0.01 < row["measured_kld"] < 0.5
    assert 0.75 <= row["predicted_over_measured"] <= 1.25, row
