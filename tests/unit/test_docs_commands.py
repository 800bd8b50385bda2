"""Every command the docs show runs here, on the tiny model, so the docs cannot rot.

The commands come from the fenced code blocks of ``README.md`` and ``docs/**/*.md`` (``docs/incoming`` is
the coordinator's inbox, not the site): every line that starts with ``tqbench`` (or ``$ tqbench``: then the
lines up to the next ``$`` are its documented output), ``\\`` continuations joined. Each runs for real, in one
process through click's ``CliRunner`` (importing torch once), and is checked: exit code 0 (or 1 with
``gate failed:`` for the commands that have a gate) and an assertion on what it printed or wrote. For
commands whose output is exact arithmetic (``kv-estimate``, ``policies``), every byte count and percentage of
the documented output must appear in the real one.

What a command is changed to run here, and why (nothing else is):

- ``--model`` of a command that loads weights becomes ``--model tiny`` (the random tiny model, built in code;
  the default model is for ``tests/integration``), ``--threads`` becomes 1 (the suite's rule);
- it runs in a temporary folder: output paths land there (their folders made first), input paths that name a
  file of the repository are made absolute;
- a prompt file is cut to 2,000 characters (the tiny model's byte-level tokenizer makes about 4x the tokens
  of SmolLM2's, past its 4,096-token context); a sweep spec runs on ``models = ["tiny"]``;
- a ``tasks`` command runs at ``--context`` 1024 at most, on one task (``niah_single``, which needs 512) and
  one sample: the command, its options and its report are what is checked, not the scores, and a 4K suite on
  the tiny model costs minutes of CPU;
- ``tqbench serve ... &`` starts as a real server process on a free port; the ``curl`` commands and the
  ``openai`` snippets of the docs then talk to it (port and model name replaced).

Python blocks run too (``Engine.load()`` gives a fresh tiny engine). A block is excluded only by an HTML
comment right above it: ``<!-- docs-test: synopsis -->`` (a usage line: instead of running it, every
``--option`` it names must exist in that command's ``--help``) or ``<!-- docs-test: skip: REASON -->``;
``SKIPPED_BLOCKS`` below lists the skips, so a new one is a conscious change.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from click.testing import CliRunner

from tqbench.cli import main

ROOT = Path(__file__).resolve().parents[2]
DOC_FILES = [ROOT / "README.md"] + sorted(p for p in (ROOT / "docs").rglob("*.md")
                                          if "incoming" not in p.relative_to(ROOT / "docs").parts)
MARKER = re.compile(r"<!--\s*docs-test:\s*(synopsis|skip:\s*(?P<reason>.*?))\s*-->")
#: the blocks excluded on purpose (file, the first command or line of the block); the reasons are in the docs
SKIPPED_BLOCKS = {
    ("docs/sweeps.md", "tqbench --headless sweep examples/sweep.toml --out sweeps/example-ray --ray"),
    ("docs/deploy.md", "tqbench --headless export tqbench/data/policies/smollm2-alloc-2.5bit.toml --to llamacpp --threads 1"),
    ("docs/speculative.md", "from tqbench.engine.cache import TQCache"),
    ("docs/measured.md", "tqbench --headless allocate --budget 2.5 --granularity head --json"),
    ("docs/serving.md", "lm_eval --model local-completions --tasks tqbench_mc --include_path tests/data/lm_eval"),
}
#: commands that load weights: they run on the tiny model
MODEL_COMMANDS = {"bench", "validate", "compare-policies", "niah", "scan", "allocate", "calibrate", "serve",
                  "export"}
#: commands with a gate: exit 1 (with ``gate failed:`` on stderr) is a documented outcome
GATED = {"validate", "compare-policies", "niah", "scan", "allocate", "kv-estimate", "sweep", "tasks"}
#: options whose value is a file the command writes
OUTPUT_OPTIONS = {"--report-json", "--report-md", "--out", "--save-session", "--resume"}
VERDICTS = ("exact-match", "near-stable", "prefix-stable-then-diverged", "diverged")
PROMPT_CHARS = 2000
CEILING = 600.0  # seconds a server may take to start before the test calls it hung (never a timing assertion)


@dataclass
class Block:
    path: str  # relative to the repository
    line: int  # of the opening fence, 1-based
    lang: str
    lines: list[str]
    marker: str | None = None  # "synopsis", "skip" or None
    reason: str = ""

    def first(self) -> str:
        """The block's first command (or line), without its comment: how ``SKIPPED_BLOCKS`` names it."""
        lines = [s for s in self.lines if s.strip() and not s.lstrip().startswith("#")]
        line = next((c.text for c in self.commands()), lines[0] if lines else "")
        return re.sub(r"\s+#.*$", "", line).rstrip("\\ ").strip()

    def commands(self) -> list[Command]:
        """The ``tqbench`` commands of the block, with their documented output (``$`` blocks)."""
        prompted = any(s.startswith("$ ") for s in self.lines)
        out: list[Command] = []
        i = 0
        while i < len(self.lines):
            raw = self.lines[i]
            text = raw[2:] if prompted and raw.startswith("$ ") else (None if prompted else raw.strip())
            i += 1
            if text is None or not re.match(r"tqbench(\s|$)", text):
                continue
            while text.endswith("\\") and i < len(self.lines):
                text = text[:-1].rstrip() + " " + self.lines[i].strip()
                i += 1
            documented = []
            while prompted and i < len(self.lines) and not self.lines[i].startswith("$ "):
                documented.append(self.lines[i])
                i += 1
            out.append(Command(self, text, documented))
        return out


@dataclass
class Command:
    block: Block
    text: str
    documented: list[str] = field(default_factory=list)

    @property
    def id(self) -> str:
        return f"{self.block.path}:{self.block.line}:{self.text[:60]}"

    @property
    def headless(self) -> bool:
        return "--headless" in shlex.split(self.text, comments=True)


def fenced_blocks(path: Path) -> list[Block]:
    rel = str(path.relative_to(ROOT))
    blocks: list[Block] = []
    pending: tuple[str, str] | None = None
    lines = path.read_text(encoding="utf-8").split("\n")
    i = 0
    while i < len(lines):
        line = lines[i]
        m = MARKER.search(line)
        if m:
            pending = ("skip", m.group("reason")) if m.group("reason") is not None else ("synopsis", "")
        elif line.lstrip().startswith("```"):
            fence = line.lstrip()
            lang = fence.strip("`").strip().split(" ")[0]
            indent = len(line) - len(fence)
            body = []
            i += 1
            while i < len(lines) and not lines[i].lstrip().startswith("```"):
                body.append(lines[i][indent:])
                i += 1
            block = Block(rel, i - len(body), lang, body)
            if pending:
                block.marker, block.reason = pending
            blocks.append(block)
            pending = None
        elif line.strip():
            pending = None  # a marker applies to the block right below it (blank lines allowed)
        i += 1
    return blocks


BLOCKS = [b for p in DOC_FILES for b in fenced_blocks(p)]
RUN = [c for b in BLOCKS if b.marker is None for c in b.commands()]
SERVE = [c for c in RUN if c.text.split()[1:2] == ["serve"]]
WORKBENCH = [c for c in RUN if not c.headless and c not in SERVE and "--version" not in c.text]
CLI = [c for c in RUN if c not in SERVE and c not in WORKBENCH]
SYNOPSES = [c for b in BLOCKS if b.marker == "synopsis" for c in b.commands()]
PYTHON = [b for b in BLOCKS if b.lang == "python" and b.marker is None]
OPENAI_PYTHON = [b for b in PYTHON if "OpenAI(" in "\n".join(b.lines)]
ENGINE_PYTHON = [b for b in PYTHON if b not in OPENAI_PYTHON]
CURL = [b for b in BLOCKS if b.marker is None and any(s.startswith("curl ") for s in b.lines)]


# ---- the extraction itself --------------------------------------------------------------------------------
def test_the_docs_show_commands_of_every_front_end_and_few_skips():
    subcommands = {subcommand(split(c.text)) for c in CLI}
    assert {"bench", "validate", "scan", "niah", "kv-estimate", "allocate", "sweep", "calibrate"} <= subcommands
    assert SERVE and WORKBENCH and CURL and OPENAI_PYTHON and ENGINE_PYTHON
    skipped = {(b.path, b.first()) for b in BLOCKS if b.marker == "skip"}
    assert skipped == SKIPPED_BLOCKS, "a skipped docs block was added or removed: update SKIPPED_BLOCKS"
    assert all(b.reason for b in BLOCKS if b.marker == "skip")


def test_extraction_joins_continuations_and_keeps_documented_output():
    block = Block("x.md", 1, "", ["$ tqbench --headless kv-estimate \\", "    --seq-len 8  # c", "out 1", "$ ls"])
    (cmd,) = block.commands()
    assert cmd.text == "tqbench --headless kv-estimate --seq-len 8  # c" and cmd.documented == ["out 1"]
    assert split(cmd.text) == ["tqbench", "kv-estimate", "--seq-len", "8"]


# ---- rewriting a documented command to run here -----------------------------------------------------------
def split(text: str) -> list[str]:
    """argv of a documented command, ``--headless`` dropped (the tests call the click group headless)."""
    argv = shlex.split(text.rstrip("&").strip(), comments=True)
    return [a for a in argv if a != "--headless"]


def subcommand(argv: list[str]) -> str:
    """The command's name; ``--version``; or "" for the workbench itself (``tqbench [--options]``)."""
    found = next((a for a in argv[1:] if a in main.commands), None)
    return found or ("--version" if "--version" in argv else "")


TASKS_CONTEXT = 1024  # the cap on a documented tasks command's --context here (see the module docstring)


def rewrite(argv: list[str], tmp: Path) -> list[str]:
    """The documented argv made to run here (see the module docstring); ``tmp`` is the working folder."""
    sub = subcommand(argv)
    out: list[str] = []
    args = iter(argv[1:])
    for arg in args:
        opt, eq, inline = arg.partition("=")
        if opt.startswith("--") and opt in OUTPUT_OPTIONS | {"--model", "--threads", "--prompt-file"} and not eq:
            value = next(args)
        elif opt.startswith("--") and eq:
            value = inline
        else:
            value = None
        if value is None:
            out.append(_input_path(arg, tmp, sub))
            continue
        if opt in ("--model", "--threads") and (sub in MODEL_COMMANDS or not sub):
            continue  # set below
        if opt in OUTPUT_OPTIONS:
            (tmp / value).parent.mkdir(parents=True, exist_ok=True)
        elif opt == "--prompt-file":
            value = _short_copy(ROOT / value, tmp)
        elif sub == "tasks" and opt == "--context":
            value = str(min(int(value), TASKS_CONTEXT))
        elif sub == "tasks" and opt == "--samples":
            value = "1"
        elif sub == "tasks" and opt == "--tasks":
            value = "niah_single"
        else:
            value = _input_path(value, tmp, sub)
        out += [opt, value]
    if sub == "tasks":
        for flag, value in (("--samples", "1"), ("--tasks", "niah_single")):
            if flag not in out:
                out += [flag, value]
    if sub in MODEL_COMMANDS or not sub:  # "": the workbench, whose --model/--threads are the group's
        out += ["--model", "tiny", "--threads", "1"]
    return out


def _input_path(value: str, tmp: Path, sub: str) -> str:
    path = ROOT / value
    if value.startswith("-") or "/" not in value or not path.is_file():
        return value
    if sub == "sweep" and path.suffix == ".toml":
        spec = re.sub(r"(?m)^models\s*=.*$", 'models = ["tiny"]', path.read_text(encoding="utf-8"))
        assert 'models = ["tiny"]' in spec, f"{value}: no models line to run on the tiny model"
        (tmp / path.name).write_text(spec, encoding="utf-8")
        return str(tmp / path.name)
    return str(path)


def _short_copy(path: Path, tmp: Path) -> str:
    copy = tmp / f"short-{path.name}"
    copy.write_text(path.read_text(encoding="utf-8")[:PROMPT_CHARS], encoding="utf-8")
    return str(copy)


def test_rewrite_runs_on_the_tiny_model_in_the_temporary_folder(tmp_path):
    argv = split("tqbench --headless scan --model default --threads 2 --prompt-file "
                 "tqbench/data/prompts/long_context.txt --report-json out/scan.json --layers 0")
    got = rewrite(argv, tmp_path)
    assert got[:2] == ["scan", "--prompt-file"] and got[-4:] == ["--model", "tiny", "--threads", "1"]
    assert Path(got[2]).read_text(encoding="utf-8") == (
        ROOT / "tqbench/data/prompts/long_context.txt").read_text(encoding="utf-8")[:PROMPT_CHARS]
    assert got[3:7] == ["--report-json", "out/scan.json", "--layers", "0"] and (tmp_path / "out").is_dir()
    # kv-estimate reads shipped configs, no weights: its --model stays
    assert rewrite(split("tqbench --headless kv-estimate --model Gemma-2-9B"), tmp_path) == [
        "kv-estimate", "--model", "Gemma-2-9B"]


# ---- what a command must have done ------------------------------------------------------------------------
def opt(argv: list[str], name: str, default=None):
    return argv[argv.index(name) + 1] if name in argv else default


def check_bench(argv, out, tmp):
    policy, mode = opt(argv, "--kv-policy", "turbo4"), opt(argv, "--cache-mode", "compressed")
    if "--json" in argv:
        d = json.loads(out)
        assert (d["kv_policy"], d["cache_mode"]) == (policy, mode)
        assert 0 < d["output_tokens"] <= int(opt(argv, "--max-new-tokens", 10**9))
        assert d["cache_report"]["compressed_storage_bytes"] > 0
    else:
        assert f"bench: {policy} ({mode})" in out and "KV stored" in out and "saved at rest" in out


def check_validate(argv, out, tmp):
    candidate = opt(argv, "--candidate", "turbo4")
    if "--teacher-forced" in argv:
        assert candidate in out and "KL mean" in out and "ppl" in out
    elif "--self-test" in argv:
        assert "exact-match" in out
    else:
        assert candidate in out and any(v in out for v in VERDICTS)


def check_compare(argv, out, tmp):
    for name in (opt(argv, "--policies") or "").split(","):
        assert name in out, name
    assert "recommended" in out and "unsafe (diverged):" in out


def check_scan(argv, out, tmp):
    assert "suggested" in out
    if opt(argv, "--report-json"):
        report = json.loads((tmp / opt(argv, "--report-json")).read_text(encoding="utf-8"))
        assert report["metrics"] and report["suggested_policy"]


def check_niah(argv, out, tmp):
    policies = opt(argv, "--policies", "turbo4,turbo2").split(",")
    assert all(p in out for p in ["fp16", *policies]) and "recall" in out
    if opt(argv, "--report-json"):
        report = json.loads((tmp / opt(argv, "--report-json")).read_text(encoding="utf-8"))
        cells = len(opt(argv, "--lengths").split(",")) * len(opt(argv, "--depths").split(","))
        assert report["cells"] and len(report["cells"]) == cells * (1 + len(policies))


def check_kv_estimate(argv, out, tmp):
    assert "KV bytes" in out and "fp16" in out


def check_policies(argv, out, tmp):
    from tqbench.engine.policy import PRESETS

    assert all(name in out for name in PRESETS)


def check_presets_table(cmd, args, runner):
    """The page's presets table (``| `name` | `policy` | bits | saved% |``) is what the command computes."""
    page = (ROOT / cmd.block.path).read_text(encoding="utf-8")
    rows = re.findall(r"(?m)^\| `([\w.-]+)` \| `([^`]+)` \| ([\d.]+) \| ([\d.]+)% \|", page)
    if not rows:
        return
    real = {r["name"]: r for r in json.loads(runner.invoke(main, ["--headless", *args, "--json"]).stdout)}
    for name, policy, bits, saved in rows:
        assert name in real, f"{cmd.block.path}: preset {name} is not listed by the command"
        got = real[name]
        assert (got["policy"], f"{got['bits_per_element']:.2f}", f"{got['saved_pct']:.1f}") == (policy, bits, saved), (
            f"{cmd.block.path}: the table's row for {name} ({policy}, {bits}, {saved}%) is not what "
            f"`{cmd.text}` computes: {got}")


def check_allocate(argv, out, tmp):
    budget = float(opt(argv, "--budget"))
    if "--json" in argv:
        d = json.loads(out)
        assert d["verified"]["bits_per_element"] <= budget and d["verified"]["kl_mean"] >= 0
        assert d["measured_cells"] + d["resumed_cells"] > 0
    if opt(argv, "--out"):
        toml = (tmp / opt(argv, "--out")).read_text(encoding="utf-8")
        assert "[policy]" in toml and "[verified]" in toml and (tmp / opt(argv, "--out")).with_suffix(
            ".safetensors").is_file()


def check_calibrate(argv, out, tmp):
    assert (tmp / opt(argv, "--out")).stat().st_size > 0 and "wrote" in out


def check_sweep(argv, out, tmp):
    report = json.loads((tmp / opt(argv, "--out") / "report.json").read_text(encoding="utf-8"))
    assert [m["model"] for m in report["models"]] == ["tiny"] and report["cells"] and not report["missing"]
    assert all(c["status"] == "ok" for c in report["cells"]), [c for c in report["cells"] if c["status"] != "ok"]


def check_export(argv, out, tmp):
    engine = opt(argv, "--to")
    flags = {"llamacpp": ("-ctk", "-ctv"), "vllm": ("--kv-cache-dtype",), "sglang": ("--kv-cache-dtype",),
             "trtllm": ("dtype",)}[engine]
    assert all(f in out for f in flags) and "bits/element" in out, out
    if "--no-measure" not in argv:
        assert "KL mean" in out and "mapped" in out, out


def check_tasks(argv, out, tmp):
    if "--json" in argv:
        d = json.loads(out)
    else:
        assert "baseline" in out and "overall" in out, out
        d = json.loads((tmp / opt(argv, "--report-json")).read_text(encoding="utf-8")) if opt(argv, "--report-json") \
            else None
    if d is not None:
        assert d["tasks"] and {r["method"] for r in d["leaderboard"]} == {d["baseline"], d["candidate"]}


def check_version(argv, out, tmp):
    from tqbench import __version__

    assert out.strip() == f"tqbench, version {__version__}"


CHECKS = {"bench": check_bench, "validate": check_validate, "compare-policies": check_compare, "scan": check_scan,
          "niah": check_niah,
          "kv-estimate": check_kv_estimate, "policies": check_policies, "allocate": check_allocate,
          "calibrate": check_calibrate, "sweep": check_sweep, "export": check_export, "tasks": check_tasks,
          "--version": check_version}
EXACT = {"kv-estimate", "policies"}  # their documented output is byte arithmetic: it must match


def documented_numbers(lines: list[str]) -> set[str]:
    """Byte counts (7+ digits) and percentages with a decimal, from a command's documented output."""
    text = "\n".join(s.split("#")[0] for s in lines)
    return set(re.findall(r"\b\d{7,}\b", text)) | set(re.findall(r"\b\d+\.\d+%", text))


@pytest.fixture(scope="module")
def runner():
    return CliRunner()


@pytest.fixture(scope="module")
def block_dirs(tmp_path_factory):
    """One working folder per docs block: a block's later commands read what its earlier ones wrote."""
    dirs: dict[tuple[str, int], Path] = {}

    def get(block: Block) -> Path:
        key = (block.path, block.line)
        if key not in dirs:
            dirs[key] = tmp_path_factory.mktemp("docs-block")
        return dirs[key]

    return get


@pytest.mark.parametrize("cmd", CLI, ids=[c.id for c in CLI])
def test_docs_command(cmd, runner, block_dirs, monkeypatch):
    tmp_path = block_dirs(cmd.block)
    argv = split(cmd.text)
    sub = subcommand(argv)
    assert sub in CHECKS, f"{cmd.id}: no check for `{sub}` commands: add one to CHECKS"
    args = rewrite(argv, tmp_path)
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(main, ["--headless", *args])
    stdout, stderr = result.stdout, result.stderr
    if result.exit_code == 1 and sub in GATED:
        assert "gate failed:" in stderr, stderr  # the documented outcome of a gate, named
    else:
        assert result.exit_code == 0, f"{cmd.text}\n-> {args}\nexit {result.exit_code}\n{result.output}\n{result.exception!r}"
    CHECKS[sub](args, stdout, tmp_path)
    if sub == "policies" and "--json" not in args:
        check_presets_table(cmd, args, runner)
    if sub in EXACT:
        missing = {n for n in documented_numbers(cmd.documented) if n not in stdout}
        assert not missing, f"{cmd.id}: documented figures not in the real output: {sorted(missing)}\n{stdout}"


@pytest.mark.parametrize("cmd", SYNOPSES, ids=[c.id for c in SYNOPSES])
def test_docs_synopsis_names_only_real_options(cmd, runner):
    argv = split(cmd.text)
    words = [w for w in cmd.text.replace("[", " ").replace("]", " ").replace("|", " ").split() if w.startswith("--")]
    sub = subcommand(argv)
    help_args = ["--help"] if sub.startswith("-") else [sub, "--help"]
    result = runner.invoke(main, ["--headless", *help_args] if sub != "serve" else help_args)
    assert result.exit_code == 0, result.output
    known = set(re.findall(r"--[a-z0-9][a-z0-9-]*", result.output))
    flags = {w.split("=")[0].split("/")[0] for w in words} - {"--headless"}
    assert flags <= known, f"{cmd.id}: not options of `{sub}`: {sorted(flags - known)}"


# ---- the workbench -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("cmd", WORKBENCH, ids=[c.id for c in WORKBENCH])
def test_docs_workbench_command(cmd, runner, block_dirs, monkeypatch):
    """The command opens the real workbench (under Textual's pilot, not a terminal): the model loads, the
    documented fields are filled in, and ctrl+r runs baseline and candidate to the end."""
    import asyncio
    import types

    from textual.widgets import Input, TextArea

    from tqbench.tui import app as tui_app

    tmp_path = block_dirs(cmd.block)
    argv = split(cmd.text)
    args = rewrite(argv, tmp_path)
    seen: dict = {}

    async def drive(options):
        app = tui_app.WorkbenchApp(options)
        async with app.run_test(size=(120, 40)) as pilot:
            deadline = time.monotonic() + CEILING
            while app.engine is None or getattr(app, "run_pane", None) is None:
                assert time.monotonic() < deadline, "the model did not load"
                await pilot.pause(0.05)
            pane = app.run_pane
            seen["candidate"] = pane.query_one("#candidate", Input).value
            seen["prompt"] = pane.query_one("#prompt", TextArea).text
            await pilot.press("ctrl+r")
            while pane.status not in ("done", "failed", "cancelled"):
                assert time.monotonic() < deadline, f"the run did not finish (status {pane.status})"
                await pilot.pause(0.05)
            seen["status"] = pane.status

    monkeypatch.setattr(tui_app, "run_workbench", lambda options: asyncio.run(drive(options)))
    tty = types.SimpleNamespace(isatty=lambda: True)
    monkeypatch.setattr("tqbench.cli.workbench.sys", types.SimpleNamespace(stdin=tty, __stderr__=tty, exit=sys.exit))
    monkeypatch.setenv("TQBENCH_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(main, args)
    assert result.exit_code == 0, f"{cmd.text}\n-> {args}\n{result.output}\n{result.exception!r}"
    assert seen.get("status") == "done", seen
    assert seen["candidate"] == opt(argv, "--kv-policy", "turbo4")
    if opt(argv, "--prompt"):
        assert seen["prompt"] == opt(argv, "--prompt")


# ---- Python blocks ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("block", ENGINE_PYTHON, ids=[f"{b.path}:{b.line}" for b in ENGINE_PYTHON])
def test_docs_python(block, monkeypatch, capsys):
    from tqbench.engine.engine import Engine

    engine = Engine.tiny()  # its own model: the fused mode reroutes a model's attention
    monkeypatch.setattr(Engine, "load", classmethod(lambda cls, *a, **k: engine))
    namespace: dict = {"__name__": "docs_snippet"}
    exec(compile("\n".join(block.lines), f"{block.path}:{block.line}", "exec"), namespace)  # noqa: S102
    printed = capsys.readouterr().out
    assert printed.strip(), f"{block.path}:{block.line} printed nothing"
    assert "engine" in namespace and namespace["engine"] is engine


# ---- serve, curl and the openai client ---------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _health(port: int):
    with contextlib.suppress(OSError):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        conn.request("GET", "/health")
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"{}")
    return None, None


@contextlib.contextmanager
def served(cmd: Command, tmp: Path):
    """The documented ``tqbench serve`` command, started for real on the tiny model: yields (port, log path)."""
    port = _free_port()
    args = rewrite(split(cmd.text), tmp) + ["--port", str(port)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    log_path = tmp / "server.log"
    with open(log_path, "w+", encoding="utf-8") as log:
        proc = subprocess.Popen([sys.executable, "-m", "tqbench", *args], cwd=tmp, env=env, stdout=log,
                                stderr=subprocess.STDOUT)
        deadline = time.monotonic() + CEILING
        try:
            while _health(port)[0] != 200:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"{cmd.id}: the server did not start (exit {proc.poll()}):\n"
                                f"{log_path.read_text(encoding='utf-8')}")
                time.sleep(0.2)
            yield port, log_path
        finally:
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(60)
            if proc.poll() is None:
                proc.kill()


@pytest.fixture(scope="module")
def docs_server(tmp_path_factory):
    """The first documented ``tqbench serve ... &``: the server the docs' curl and openai examples talk to."""
    cmd = next(c for c in SERVE if c.text.rstrip().endswith("&"))
    with served(cmd, tmp_path_factory.mktemp("serve")) as (port, log_path):
        yield cmd, port, log_path


def _served(text: str, port: int) -> str:
    """A docs snippet pointed at the test's server: its port, and the tiny model's alias for the model name."""
    text = re.sub(r"(localhost|127\.0\.0\.1):8000", f"127.0.0.1:{port}", text)
    return text.replace("SmolLM2-135M-Instruct", "tiny")


@pytest.mark.server
@pytest.mark.parametrize("cmd", SERVE, ids=[c.id for c in SERVE])
def test_docs_serve_command_serves(cmd, request, tmp_path):
    """The server starts with the documented options: /health reports its policy, mode and KV budget."""
    argv = split(cmd.text)
    with contextlib.ExitStack() as stack:
        if cmd.text.rstrip().endswith("&"):
            _, port, log_path = request.getfixturevalue("docs_server")
        else:
            port, log_path = stack.enter_context(served(cmd, tmp_path))
        status, health = _health(port)
        assert status == 200, health
        assert health["kv_policy"] == opt(argv, "--kv-policy", "turbo4"), health
        if opt(argv, "--kv-budget") not in (None, "auto"):
            from tqbench.server.admission import parse_bytes

            assert health["kv_budget"]["budget_bytes"] == parse_bytes(opt(argv, "--kv-budget")), health
        startup = log_path.read_text(encoding="utf-8")
        assert f"kv_policy {health['kv_policy']}, cache mode {health['cache_mode']}" in startup, startup


@pytest.mark.server
@pytest.mark.parametrize("block", CURL, ids=[f"{b.path}:{b.line}" for b in CURL])
def test_docs_curl(block, docs_server):
    if not (shutil.which("curl") and shutil.which("jq")):
        pytest.skip("curl and jq are not installed")
    _, port, _ = docs_server
    script = "\n".join(s for s in block.lines if not s.startswith("tqbench serve"))
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", _served(script, port)], capture_output=True,
                          text=True, timeout=CEILING)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    if '"stream": true' in script:
        assert out.rstrip().endswith("data: [DONE]") and '"tqbench"' in out
    else:  # jq's output: one JSON value per filter result, none of them missing (null)
        values, rest, decoder = [], out.strip(), json.JSONDecoder()
        while rest:
            value, end = decoder.raw_decode(rest)
            values.append(value)
            rest = rest[end:].strip()
        assert values and all(v is not None for v in values), out


@pytest.mark.server
@pytest.mark.parametrize("block", OPENAI_PYTHON, ids=[f"{b.path}:{b.line}" for b in OPENAI_PYTHON])
def test_docs_openai_python(block, docs_server, capsys):
    pytest.importorskip("openai")
    _, port, _ = docs_server
    before = _health(port)[1]["requests"]
    namespace: dict = {"__name__": "docs_snippet"}
    exec(compile(_served("\n".join(block.lines), port), f"{block.path}:{block.line}", "exec"), namespace)  # noqa: S102
    printed = capsys.readouterr().out
    after = _health(port)[1]["requests"]
    assert printed.strip(), f"{block.path}:{block.line} printed nothing"
    assert after != before, f"{block.path}:{block.line} sent no request to the server ({before} -> {after})"
