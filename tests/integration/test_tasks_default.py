"""The long-context task suite on the real default model (SmolLM2-135M-Instruct): one short sample."""

from __future__ import annotations

import pytest

from tests.integration.default_model import require_default_model
from tqbench.engine.engine import Engine
from tqbench.engine.tasks import run_tasks

pytestmark = pytest.mark.integration


def test_the_baseline_finds_a_needle_at_1k(tmp_path):
    require_default_model()
    engine = Engine.load("default", device="cpu", dtype="float32")
    res = run_tasks(engine, "turbo4", 1024, tasks=["niah_single"], samples=1, cache_folder=tmp_path)
    s = res.samples[0]
    assert 1024 - 64 - 16 <= s["prompt_tokens"] <= 1024 - 16
    # the 7-digit magic number of seed 0 (measured: SmolLM2-135M-Instruct answers it, fp32 CPU)
    assert s["references"] == ["6648936"] and "6648936" in s["baseline_answer"]
    assert s["baseline_score"] == 1.0 and res.task_row("niah_single")["baseline_score"] == 100.0
    assert 0.6 < res.leaderboard()[1]["compression_ratio"] < 0.75  # turbo4: about 4.7 bits of 16
