"""Every subcommand's ``--help`` has an example that names only options the command has, every option a
description; click's usage errors are one line like tqbench's own, with a usage line that runs."""

from __future__ import annotations

import shlex

import pytest
from click.testing import CliRunner

from tqbench.cli import main
from tqbench.cli.examples import COSTS, EXAMPLES


def run(*args):
    return CliRunner().invoke(main, list(args))


@pytest.mark.parametrize("name", sorted(main.commands))
def test_every_subcommand_has_examples_and_described_options(name):
    cmd = main.commands[name]
    assert name in EXAMPLES
    options = {o for p in cmd.params for o in getattr(p, "opts", [])}
    for example in EXAMPLES[name]:
        words = shlex.split(example)
        assert words[0] == "tqbench" and name in words
        assert {w.split("=")[0] for w in words if w.startswith("--") and w != "--headless"} <= options, example
    undocumented = [p.opts[0] for p in cmd.params if isinstance(p, type(cmd.params[0])) and p.param_type_name ==
                    "option" and not p.help]
    assert undocumented == [], f"{name}: options without a description: {undocumented}"
    r = run("--headless", name, "--help")
    assert r.exit_code == 0 and "Examples:" in r.output and EXAMPLES[name][0] in r.output
    assert r.output.splitlines()[0].startswith(f"Usage: main --headless {name} ")
    if name in COSTS:
        assert "2-core CPU" in r.output


@pytest.mark.parametrize("args, message", [
    (["bench", "--bogus"], "error: no such option '--bogus' (usage: main --headless bench [OPTIONS]; "
                           "main --headless bench --help lists the options)"),
    (["export", "turbo4"], "error: missing option '--to'. Choose from: llamacpp, vllm, sglang, trtllm "
                           "(usage: main --headless export [OPTIONS] POLICY;"),
    (["bench", "--max-new-tokens", "x"], "error: invalid value for '--max-new-tokens': 'x' is not a valid integer"),
    (["nosuch"], "error: no such command 'nosuch' (usage: main [OPTIONS] [COMMAND] [ARGS]...;"),
])
def test_click_usage_errors_are_one_line(args, message):
    r = run("--headless", *args)
    assert r.exit_code == 2
    assert r.stderr.startswith(message) and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_kv_estimate_at_several_contexts_is_a_table_and_a_chart(tmp_path):
    r = run("--headless", "kv-estimate", "--kv-policy", "fp16;turbo4", "--seq-len", "1024,4096,8192,32768",
            "--report-md", str(tmp_path / "k.md"))
    assert r.exit_code == 0, r.output
    assert "32768 tokens" in r.stdout and "720.00 MiB" in r.stdout  # fp16 at 32K: 30 x 3 x 64 x 2 x 2 x 32768 bytes
    assert "KV cache MiB against context tokens" in r.stdout and "* fp16   + turbo4" in r.stdout
    assert "| fp16 | 23592960 | 94371840 | 188743680 | 754974720 |" in (tmp_path / "k.md").read_text()
    j = run("--headless", "kv-estimate", "--kv-policy", "turbo4", "--seq-len", "1024,4096", "--json")
    d = __import__("json").loads(j.stdout)
    assert d["seq_lens"] == [1024, 4096] and [x["seq_len"] for x in d["reports"]] == [1024, 4096]
    bad = run("--headless", "kv-estimate", "--seq-len", "1024,x")
    assert bad.exit_code == 2 and "error: --seq-len '1024,x' is invalid: give token counts" in bad.stderr
    zero = run("--headless", "kv-estimate", "--seq-len", "1024,0")  # the engine's one rule for a count
    assert zero.exit_code == 2 and "error: --seq-len=0 is invalid: use at least 1 token" in zero.stderr
    one = run("--headless", "kv-estimate", "--kv-policy", "turbo4")
    assert "KV size" in one.stdout  # the human-readable column has a header
