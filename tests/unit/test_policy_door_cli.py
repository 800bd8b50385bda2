"""Policies at the CLI's door (issue 42): a bad policy is a one-line error, exit 2, before torch loads; equal
policies get one label, different ones different labels; the policy help says what keep/chunk mean in kvpress's
terms; validate refuses flags it would ignore and says when a prompt is too short to test eviction."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from tqbench.cli import main
from tqbench.engine.policy import parse_policy
from tqbench.engine.validate.recommendation import recommend, short_for_eviction


def run(*args):
    return CliRunner().invoke(main, ["--headless", *args])


_DOOR = """
import sys
from click.testing import CliRunner
from tqbench.cli import main
out = []
for pol in {policies!r}:
    r = CliRunner().invoke(main, ["--headless", "kv-estimate", "--kv-policy", pol])
    out.append([r.exit_code, r.output])
print(repr(("torch" in sys.modules, out)))
"""

BAD = {
    "turbo4,keep=1.5": "error: keep=1.5 is invalid: use a fraction 0 < f <= 1",
    "turbo4,keep=0.5,demote=fp32": "error: demote=fp32 is not cheaper than the rows it replaces (kv=turbo4: 4 bits "
                                   "per element)",
    "turbo4,keep=0.5,keep=0.25": "error: policy 'turbo4,keep=0.5,keep=0.25' sets keep twice",
    "k=turbo4,k=turbo2": "error: policy 'k=turbo4,k=turbo2' sets k twice",
    "turbo4,keep=2": "error: keep=2 is ambiguous: write keep=2rows for a row count per KV head or keep=0.5 for a "
                     "fraction of the rows",
    "fp16;turbo9": "error: unknown policy preset 'turbo9'",
}


def test_a_bad_policy_is_one_line_exit_2_before_torch_loads():
    """The must-show of issue 42 (refused in under 2 s): the grammar is checked without importing torch."""
    code = _DOOR.format(policies=list(BAD))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    torch_loaded, out = eval(res.stdout.strip().splitlines()[-1])  # noqa: S307 - our own repr
    assert torch_loaded is False
    for (code_, output), want in zip(out, BAD.values()):
        assert code_ == 2 and output.startswith(want) and len(output.strip().splitlines()) == 1, output


def test_kv_estimate_labels_equal_policies_alike_and_different_ones_apart():
    r = run("kv-estimate", "--kv-policy", "turbo4,keep=1;turbo4,keep=1.0;turbo4,keep=64rows;turbo4,keep=0.5",
            "--seq-len", "4096", "--json")
    assert r.exit_code == 0, r.output
    rows = json.loads(r.output)["rows"]
    labels = [row["kv_policy"] for row in rows]
    assert labels == ["turbo4", "turbo4", "k=turbo4,v=turbo4,sink=4,recent=16,keep=64rows",
                      "k=turbo4,v=turbo4,sink=4,recent=16,keep=0.5"]
    assert rows[0] == rows[1] and rows[2]["total_bytes"] < rows[3]["total_bytes"] < rows[0]["total_bytes"]
    for label, row in zip(labels, rows):  # each label parses back to the policy its numbers are of
        again = run("kv-estimate", "--kv-policy", label, "--seq-len", "4096", "--json")
        assert json.loads(again.output)["rows"][0]["total_bytes"] == row["total_bytes"]


@pytest.mark.parametrize("command", ["kv-estimate", "bench", "validate", "tasks", "serve", "compare-policies",
                                     "niah"])
def test_the_policy_help_states_kvpress_mapping(command):
    r = run(command, "--help")
    text = " ".join(r.output.split())
    assert "compression_ratio=r is keep=1-r" in text and "ChunkKVPress(chunk_length=8)" in text
    assert "keep=512rows" in text


def test_validate_refuses_teacher_forced_sizes_without_a_corpus():
    r = run("validate", "--model", "tiny", "--teacher-forced", "--tf-context", "256", "--tf-tokens", "16")
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1
    assert r.output.startswith("error: --tf-context and --tf-tokens size a teacher-forced run on a shipped text: "
                               "add --corpus")


def test_a_prompt_too_short_to_evict_from_is_said_not_blamed_on_the_codec():
    pol = parse_policy("turbo4,keep=0.5")
    why = short_for_eviction(pol, 41)
    assert why.startswith("the prompt (41 tokens) is too short to test eviction: every KV head keeps its 4 sink "
                          "and last 32 rows anyway") and why.endswith("use a prompt of 72+ tokens or teacher-forced "
                                                                      "quality on a shipped corpus text")
    assert short_for_eviction(pol, 72) is None and short_for_eviction(parse_policy("turbo4"), 41) is None
    rec = recommend("diverged", pol, prompt_tokens=41)
    assert rec.cause_hint == why and "uniform" not in rec.cause_hint and rec.status == "unsafe"
    assert recommend("exact-match", pol, prompt_tokens=41).status == "unproven"
    assert recommend("diverged", pol, prompt_tokens=400).cause_hint.startswith("uniform 4-bit K and V")


@pytest.mark.parametrize("args", [["serve", "--kv-policy", "turbo4,keep=2"],
                                  ["bench", "--kv-policy", "turbo4,keep=0.5,demote=fp32"],
                                  ["validate", "--candidate", "k=turbo4,k=turbo2"],
                                  ["tasks", "--candidate", "turbo4,keep=1.5"],
                                  ["compare-policies", "--policies", "turbo4;turbo4,keep=2"],
                                  ["export", "turbo4,keep=0.5,keep=0.25", "--to", "llamacpp"],
                                  ["--kv-policy", "turbo4,keep=2"]])  # the workbench's, before its UI starts
def test_every_command_that_takes_a_policy_refuses_a_bad_one_at_the_door(args):
    r = run(*args)  # (serve would start silently with keep=2 before: issue 42)
    assert r.exit_code == 2 and r.output.startswith("error: ") and len(r.output.strip().splitlines()) == 1, r.output
