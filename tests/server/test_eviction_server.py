"""Token eviction through the server: a per-request ``kv_policy`` with keep= runs, its cache report is the
engine's (rows evicted), and admission reserves the evicted size (the estimate at prompt + max_tokens)."""

from __future__ import annotations

import openai
import pytest
from serverkit import CEILING

pytestmark = pytest.mark.server

MESSAGES = [{"role": "user", "content": "Name three colours and three animals, then count to ten."}]
POLICY = "turbo4,keep=0.5,score=tova,window=4,every=4"


def test_per_request_keep_policy_runs_as_solo(live_server, tiny_engine):
    client = openai.OpenAI(base_url=live_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=CEILING)
    got = client.chat.completions.create(model="tiny-random", messages=MESSAGES, max_tokens=10,
                                         extra_body={"kv_policy": POLICY, "cache_report": "layers"})
    solo = tiny_engine.generate(MESSAGES, POLICY, max_new_tokens=10)
    report = got.model_extra["tqbench"]["cache_report"]
    assert report["compressed_storage_bytes"] == solo.cache_report.compressed_storage_bytes
    assert sum(r["evicted_prefill"] for r in report["layers"]) > 0


def test_admission_reserves_the_evicted_size(tiny_engine):
    from tqbench.engine.cache.estimate import estimate_kv
    from tqbench.server.admission import request_kv_bytes

    geo = tiny_engine.geometry
    full = request_kv_bytes("turbo4", geo, 300, prompt=200)
    half = request_kv_bytes("turbo4,keep=0.5", geo, 300, prompt=200)
    assert half == estimate_kv("turbo4,keep=0.5", geo, 300, prefill=200).total_bytes < full
    # with re-eviction the peak is just before the last eviction point, not at the end
    pol = "turbo4,keep=0.5,every=64"
    peak = max(estimate_kv(pol, geo, n, prefill=200).total_bytes for n in range(200, 301))
    assert request_kv_bytes(pol, geo, 300, prompt=200) == peak
