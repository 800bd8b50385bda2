"""llama.cpp's tool finder/builder, without building: where tools come from, what a missing compiler says, the
lock, and the CLI's exit codes. (The build itself is exercised by ``tqbench --headless llamacpp build``, never by
the test suite.)"""

from __future__ import annotations

import json
import os
import stat

import pytest
from click.testing import CliRunner

from tqbench.engine.deploy import llamacpp as lc


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TQBENCH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(lc.DIR_ENV, raising=False)
    return tmp_path


def _fake_tool(folder, name):
    folder.mkdir(parents=True, exist_ok=True)
    p = folder / name
    p.write_text("#!/bin/sh\n")
    p.chmod(p.stat().st_mode | stat.S_IXUSR)
    return p


def test_not_built_is_none_and_status_says_so(empty_cache):
    assert lc.llamacpp_dir().is_relative_to(empty_cache / "cache")
    assert lc.llamacpp_dir().name == f"{lc.LLAMACPP_VERSION}-{lc.SDIST_SHA256[:12]}"
    assert lc.find_llamacpp_tool("llama-perplexity") is None
    st = lc.llamacpp_status()
    assert st["ready"] is False and "not built" in st["reason"]
    with pytest.raises(ValueError, match="unknown llama.cpp tool 'llama-cli'"):
        lc.find_llamacpp_tool("llama-cli")


def test_cached_build_needs_its_stamp_and_the_tools_asked_for(empty_cache):
    root = lc.llamacpp_dir()
    tools = {t: _fake_tool(root / "build" / "bin", t) for t in lc.TOOLS}
    assert lc.find_llamacpp_tool("llama-bench") is None  # no build.json: a killed build is not a build
    (root / lc.STAMP).write_text(json.dumps({"version": lc.LLAMACPP_VERSION,
                                             "tools": {t: str(p) for t, p in tools.items()}}))
    assert lc.find_llamacpp_tool("llama-bench") == tools["llama-bench"]
    assert lc.build_llamacpp(lambda m: pytest.fail(m)).origin.startswith("cached build in")
    tools["llama-server"].unlink()  # a tool gone: the others are still found, a build of all would build it
    assert lc.find_llamacpp_tool("llama-bench") == tools["llama-bench"]
    assert lc.find_llamacpp_tool("llama-server") is None
    assert lc.build_llamacpp(lambda m: pytest.fail(m), tools=("llama-perplexity",)).tools["llama-perplexity"] \
        == tools["llama-perplexity"]
    with pytest.raises(ValueError, match="unknown llama.cpp tools"):
        lc.build_llamacpp(lambda m: None, tools=("llama-cli",))


def test_prebuilt_folder_wins_and_a_wrong_one_is_an_error(empty_cache, monkeypatch):
    p = _fake_tool(empty_cache / "bin", "llama-perplexity")
    monkeypatch.setenv(lc.DIR_ENV, str(empty_cache / "bin"))
    assert lc.find_llamacpp_tool("llama-perplexity") == p
    assert lc.find_llamacpp_tool("llama-server") is None
    monkeypatch.setenv(lc.DIR_ENV, str(empty_cache / "nothing"))
    with pytest.raises(lc.LlamaCppUnavailable, match="holds none of llama-perplexity"):
        lc.find_llamacpp_tool("llama-perplexity")


def test_missing_compiler_is_named_with_how_to_get_it(empty_cache, monkeypatch):
    monkeypatch.setattr(lc.shutil, "which", lambda name: None if name in ("cmake", "c++", "g++", "clang++") else "/x")
    with pytest.raises(lc.LlamaCppUnavailable, match=r"missing cmake \(apt-get install cmake.*a C\+\+ compiler"):
        lc.build_llamacpp(lambda m: None)
    assert "cannot be built here: missing cmake" in lc.llamacpp_status()["reason"]


def test_builder_lock_records_the_holder(empty_cache):
    root = empty_cache / "b"
    with lc._builder_lock(root, lambda m: pytest.fail(m)):
        assert (root / lc.LOCK).read_text().strip() == str(os.getpid())


def test_cli_status_exit_codes(empty_cache):
    from tqbench.cli.group import main

    r = CliRunner().invoke(main, ["--headless", "llamacpp", "status", "--json"])
    assert r.exit_code == 1 and json.loads(r.output)["ready"] is False


def test_a_cached_build_without_a_tool_is_completed_incrementally(empty_cache, monkeypatch):
    """A cache built before llama-server was a target: status lists it as not built, and a build compiles only
    that target in the cached build folder (saying so), keeping the tools already built."""
    from tqbench.cli.group import main

    root = lc.llamacpp_dir()
    old = {t: _fake_tool(root / "build" / "bin", t) for t in ("llama-perplexity", "llama-bench")}
    (root / lc.STAMP).write_text(json.dumps({"version": lc.LLAMACPP_VERSION,
                                             "tools": {t: str(p) for t, p in old.items()}}))
    st = lc.llamacpp_status()
    assert st["ready"] and st["missing"] == ["llama-server"]
    assert st["missing_note"].startswith("llama-server not built: a build adds it to cached build in")
    r = CliRunner().invoke(main, ["--headless", "llamacpp", "status"])
    assert r.exit_code == 0 and "  llama-server: not built" in r.output
    assert "tqbench --headless llamacpp build --tool llama-server" in r.output
    src = lc._source_dir(root)
    src.mkdir(parents=True)
    (src / "CMakeLists.txt").write_text("")
    monkeypatch.setattr(lc, "_missing_build_tools", lambda: None)
    ran = []

    def fake_run(cmd, log, say, what):
        ran.append(cmd)
        if what == "compile":
            for t in cmd[cmd.index("--target") + 1:]:
                _fake_tool(root / "build" / "bin", t)

    monkeypatch.setattr(lc, "_run", fake_run)
    said = []
    b = lc.build_llamacpp(said.append)
    assert ran[-1][-2:] == ["--target", "llama-server"]  # only the missing target
    assert any(m.startswith("completing the cached build: compiling llama-server only (llama-perplexity, "
                            "llama-bench already built; an incremental build in") for m in said)
    assert set(b.tools) == set(lc.TOOLS) and b.tools["llama-bench"] == old["llama-bench"]
    assert lc.llamacpp_status()["missing"] == []
