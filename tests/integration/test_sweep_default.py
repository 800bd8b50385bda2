"""The shipped example sweep on the real default model, cut to one policy and short texts so it stays a short
run: the CLI in-process and with --ray (a fresh local cluster) write the same numbers. The full example is
``benchmarks/sweep.py``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tomllib
from click.testing import CliRunner

from tests.integration.default_model import require_default_model
from tqbench.cli import main
from tqbench.engine.sweep import SweepDir, numbers

pytestmark = pytest.mark.integration
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "sweep.toml"


@pytest.fixture(scope="module")
def spec_file(tmp_path_factory) -> Path:
    require_default_model()
    data = tomllib.loads(EXAMPLE.read_text(encoding="utf-8"))
    assert data["models"] == ["default"]
    text = EXAMPLE.read_text(encoding="utf-8")
    text = text.replace("max_new_tokens = 32", "max_new_tokens = 8").replace("length = 256", "length = 64")
    text = text.replace('  "turbo4",\n', "").replace('  "k=turbo3,v=turbo3,sink=4,recent=32",   # a compact policy string\n', "")
    text = text.replace("context_tokens = 256", "context_tokens = 64").replace("eval_tokens = 64", "eval_tokens = 8")
    path = tmp_path_factory.mktemp("sweep-default") / "short.toml"
    path.write_text(text, encoding="utf-8")
    return path


def test_example_spec_in_process_and_on_ray_give_the_same_numbers(spec_file, tmp_path):
    runner = CliRunner()
    local = runner.invoke(main, ["--headless", "sweep", str(spec_file), "--out", str(tmp_path / "local"), "--json"])
    assert local.exit_code == 0, local.output
    ray = runner.invoke(main, ["--headless", "sweep", str(spec_file), "--out", str(tmp_path / "ray"), "--json",
                               "--ray", "local"])
    assert ray.exit_code == 0, ray.output
    a, b = json.loads(local.stdout), json.loads(ray.stdout)
    assert [c["cell_id"] for c in a["cells"]] == [c["cell_id"] for c in b["cells"]] and len(a["cells"]) == 3
    assert a["models"][0]["model_name"] == "SmolLM2-135M-Instruct"
    assert [numbers(c) for c in a["cells"]] == [numbers(c) for c in b["cells"]]
    assert all(c["where"].startswith("ray node") for c in b["cells"])
    assert a["models"][0]["recommendation"] == b["models"][0]["recommendation"]
    assert SweepDir(tmp_path / "ray").read_cell(a["cells"][0]["cell_id"])["status"] == "ok"
