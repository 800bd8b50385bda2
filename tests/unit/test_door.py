"""Bad input is refused at the door (issue 33): a one-line error, exit code 2, before any model loads; nothing is
silently wrong. Policy lists, empty policy files, output paths (one rule for all), budgets, teacher-forced
counts, prompts and KL gates."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from tqbench.cli import main
from tqbench.engine.allocate.budget import DENSE_BITS, check_budget
from tqbench.engine.atomic import check_output_path
from tqbench.engine.policy import parse_policy, split_policies
from tqbench.engine.tomlfile import read_toml

REPO = Path(__file__).resolve().parents[2]
COMPACT = "k=turbo4,v=turbo3,sink=4,recent=16"


def run(*args):
    return CliRunner().invoke(main, ["--headless", *args])


def one_line_error(r, text: str) -> None:
    """Exit 2 and exactly ``error: text`` on stderr (``text`` ending in ``...``: the line starts with the rest)."""
    assert r.exit_code == 2, (r.exit_code, r.output)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1, r.stderr
    if text.endswith("..."):
        assert lines[0].startswith(f"error: {text[:-3]}"), r.stderr
    else:
        assert lines[0] == f"error: {text}", r.stderr
    assert "Traceback" not in r.output


@pytest.fixture
def no_model(monkeypatch):
    """Fail the test if a command gets as far as loading a model."""
    import tqbench.cli.render.console as console

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded: this input should have been refused at the door")

    monkeypatch.setattr(console, "load_engine", refuse)


# ---- policy lists (item 4) -------------------------------------------------------------------------------
@pytest.mark.parametrize("text, policies", [
    (COMPACT, [COMPACT]),
    ("turbo4,recent=64", ["turbo4,recent=64"]),  # a preset that leads a compact policy
    ("fp16,turbo4", ["fp16", "turbo4"]),  # names only: a list
    ("fp16, turbo4 ,llamacpp:q8_0/q4_0", ["fp16", "turbo4", "llamacpp:q8_0/q4_0"]),
    (f"fp16,turbo4;{COMPACT}; turbo2", ["fp16", "turbo4", COMPACT, "turbo2"]),
    (" ; ", []),
])
def test_split_policies_never_cuts_a_compact_policy(text, policies):
    assert split_policies(text) == policies


def test_kv_estimate_compact_policy_is_one_row():
    r = run("kv-estimate", "--kv-policy", COMPACT, "--seq-len", "1024", "--json")
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)["rows"]
    assert [row["kv_policy"] for row in rows] == [COMPACT]
    assert rows[0]["kv_policy_string"] == parse_policy(COMPACT).to_string()


def test_kv_estimate_policies_repeat_or_take_semicolons():
    r = run("kv-estimate", "--kv-policy", "fp16,turbo4", "--kv-policy", f"{COMPACT};turbo2", "--seq-len", "1024",
            "--json")
    assert r.exit_code == 0, r.output
    assert [row["kv_policy"] for row in json.loads(r.stdout)["rows"]] == ["fp16", "turbo4", COMPACT, "turbo2"]


def test_a_list_mixed_with_key_values_is_refused_not_split():
    one_line_error(run("kv-estimate", "--kv-policy", "fp16,turbo4,sink=4"),
                   "policy part 'turbo4' is not key=value (several policies? put ';' between them): valid keys are "
                   "k, v, kv, sink, recent, srecent, group, kblock, seed, window, chunk, every, sparsev, ada_floor, protect, "
                   "bypass, sliding, rotation, name, calib, score, demote, heads, budget, center, vcenter, normfix, keep, "
                   "k@<layers>, v@<layers>, kv@<layers>, keep@<layers>, demote@<layers>")


def test_compare_policies_takes_a_compact_policy_whole(no_model, monkeypatch):
    """The names reach the engine whole: the fragments (v=turbo3 ...) would each parse as a policy."""
    import tqbench.cli.compare as compare

    seen = []

    def stop(*args):
        raise ValueError("stop here")

    monkeypatch.setattr(compare, "check_out_paths", stop)  # right after the policies and prompts are read
    real = parse_policy

    def spy(text):
        seen.append(text)
        return real(text)

    monkeypatch.setattr("tqbench.engine.policy.parse_policy", spy)
    monkeypatch.setattr("tqbench.engine.parse_policy", spy, raising=False)
    r = run("compare-policies", "--policies", COMPACT, "--policies", "turbo2")
    one_line_error(r, "stop here")
    # read at the door (policy_option, before any path or engine): whole, never fragments (v=turbo3 ...)
    assert seen == [COMPACT, "turbo2", "fp16"]


@pytest.mark.parametrize("command", ["kv-estimate", "compare-policies", "niah"])
def test_policy_options_state_the_list_rule(command):
    r = run(command, "--help")
    assert "Repeat the option for several policies, or put ';' between them" in " ".join(r.output.split())


# ---- empty policy files (item 5) ------------------------------------------------------------------------------
@pytest.mark.parametrize("name, body", [("e.toml", ""), ("e.json", ""), ("t.toml", "[policy]\n"), ("o.json", "{}"),
                                        ("w.json", " \n")])
def test_an_empty_policy_file_is_refused(tmp_path, name, body):
    path = tmp_path / name
    path.write_text(body)
    one_line_error(run("kv-estimate", "--kv-policy", str(path)),
                   f"policy file {path} is empty: a policy file holds one object with keys k, v, sink, recent, ... "
                   "(or preset = a preset's name)")


# ---- output paths: one rule (items 6 and 10) ---------------------------------------------------------------
def test_output_path_rule(tmp_path):
    assert check_output_path(tmp_path / "r.json", ".json") == tmp_path / "r.json"
    with pytest.raises(ValueError, match=r"^--x '.*' is a folder: give a file path inside it$"):
        check_output_path(tmp_path, None, "--x")
    with pytest.raises(ValueError, match=r"folder '.*missing' does not exist: create it or pick another path$"):
        check_output_path(tmp_path / "missing" / "r.json", None, "--x")
    assert not (tmp_path / "missing").exists()  # never created on the way
    with pytest.raises(ValueError, match=r"must end in \.toml$"):
        check_output_path(tmp_path / "p.json", ".toml", "--out")
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="is a file, not a folder"):
        check_output_path(tmp_path / "f", None, "--out", folder=True)
    assert check_output_path(tmp_path / "new" / "deeper", None, "--out", folder=True)  # a folder the job creates
    assert os.listdir(tmp_path) == ["f"]  # the write check leaves nothing behind


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc")
def test_output_path_in_a_folder_that_takes_no_file():
    with pytest.raises(ValueError, match=r"^--save-session '/proc/x': folder '/proc' is not writable: pick another "
                                         r"path$"):
        check_output_path("/proc/x", None, "--save-session")


@pytest.mark.parametrize("args, flag, name", [
    (["kv-estimate"], "--report-json", "r.json"),
    (["kv-estimate"], "--report-md", "r.md"),
    (["export", "turbo4", "--to", "vllm", "--no-measure"], "--report-json", "r.json"),
    (["validate", "--model", "tiny"], "--report-json", "r.json"),
    (["validate", "--model", "tiny"], "--save-session", "s"),
    (["bench", "--model", "tiny"], "--save-session", "s"),
    (["scan", "--model", "tiny"], "--save-session", "s"),
    (["compare-policies", "--model", "tiny"], "--save-session", "s"),
    (["allocate", "--model", "tiny", "--budget", "3"], "--out", "p.toml"),
    (["calibrate", "--model", "tiny"], "--out", "t.safetensors"),
])
def test_every_output_path_is_checked_before_any_work(no_model, tmp_path, args, flag, name):
    bad = tmp_path / "nowhere" / name
    one_line_error(run(*args, flag, str(bad)),
                   f"{flag} {str(bad)!r}: folder {str(bad.parent)!r} does not exist: create it or pick another path")
    assert not bad.parent.exists()
    folder = tmp_path / f"folder{Path(name).suffix}"
    folder.mkdir()
    one_line_error(run(*args, flag, str(folder)), f"{flag} {str(folder)!r} is a folder: give a file path inside it")


def test_sweep_out_folder_must_not_be_a_file(tmp_path):
    (tmp_path / "out").write_text("x")
    r = run("sweep", str(REPO / "examples" / "sweep.toml"), "--out", str(tmp_path / "out"))
    one_line_error(r, f"--out {str(tmp_path / 'out')!r} is a file, not a folder: give a folder path")


# ---- budgets (item 11) ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("budget", [0, -1, 1, 16, 100, float("nan")])
def test_budget_bounds(budget):
    with pytest.raises(ValueError, match="is out of range: give a number above 1 .the cheapest codec, turbo1"):
        check_budget(budget, ["turbo1", "turbo4"])


def test_budget_bounds_follow_the_codecs():
    check_budget(2.5, ["turbo2", "turbo4"])
    check_budget(15.9, ["turbo2"])
    with pytest.raises(ValueError, match=r"above 2 \(the cheapest codec, turbo2, needs more\) and below 16"):
        check_budget(1.5, ["turbo4", "turbo2"])
    check_budget(0.5)  # no codecs: only (0, 16)
    assert DENSE_BITS == 16.0


@pytest.mark.parametrize("budget", ["100", "0", "-1"])
def test_allocate_budget_is_refused_before_the_model_loads(no_model, budget):
    one_line_error(run("allocate", "--budget", budget),
                   f"budget {float(budget):g} bits/element is out of range: give a number above 1 (the cheapest "
                   "codec, turbo1, needs more) and below 16 (fp16 needs no allocation), e.g. 3.0")


def test_allocate_budget_checks_the_given_codecs(no_model):
    one_line_error(run("allocate", "--budget", "2", "--codecs", "turbo3,turbo4"),
                   "budget 2 bits/element is out of range: give a number above 3 (the cheapest codec, turbo3, needs "
                   "more) and below 16 (fp16 needs no allocation), e.g. 3.0")


def test_the_engine_refuses_the_budget_before_measuring(tiny_engine):
    from tqbench.engine import allocate_policy

    with pytest.raises(ValueError, match="budget 20 bits/element is out of range"):
        allocate_policy(tiny_engine, 20.0, calibration="no-such-text")  # the budget first, before the texts


def test_the_allocation_panel_uses_the_same_rule():
    import inspect

    from tqbench.tui.panes import allocate as panel

    src = inspect.getsource(panel.AllocatePanel._settings)
    assert "check_budget(budget, " in src and "budget <= 0" not in src


# ---- gates, prompts, teacher-forced counts (items 11 and 15) -------------------------------------------------
@pytest.mark.parametrize("args, text", [
    (["validate", "--teacher-forced", "--max-kl", "-1"], "--max-kl -1 is invalid: a KL is 0 or more (e.g. 0.05)"),
    (["allocate", "--budget", "3", "--max-kl", "-0.5"], "--max-kl -0.5 is invalid: a KL is 0 or more (e.g. 0.05)"),
    (["validate", "--prompt", "  "], "the prompt is empty: give some text with --prompt or --prompt-file"),
    (["bench", "--prompt", ""], "the prompt is empty: give some text with --prompt or --prompt-file"),
    (["scan", "--prompt", "\n"], "the prompt is empty: give some text with --prompt or --prompt-file"),
    (["compare-policies", "--prompt", "hi", "--prompt", " "],
     "the prompt is empty: give some text with --prompt or --prompt-file"),
    (["validate", "--teacher-forced", "--tf-tokens", "0"], "--tf-tokens=0 is invalid: give at least 1 token"),
    (["validate", "--teacher-forced", "--corpus", "bread", "--tf-context", "-3"],
     "--tf-context=-3 is invalid: give at least 1 token"),
    (["validate", "--teacher-forced", "--corpus", "soup"],
     "unknown corpus text 'soup': shipped texts are bread, lighthouses, rivers"),
    (["allocate", "--budget", "3", "--calibration", "soup"],
     "text 'soup' is neither a text file nor a shipped text: give a file path or one of ..."),
    (["allocate", "--budget", "3", "--unseen-text", "heldout:soup"], "text 'heldout:soup' is neither a text file..."),
    (["export", "turbo4", "--to", "vllm", "--corpus", "soup"],
     "unknown corpus text 'soup': shipped texts are bread, lighthouses, rivers"),
])
def test_refused_before_the_model_loads(no_model, args, text):
    one_line_error(run(*args, "--model", "tiny"), text)


def test_empty_prompt_file_is_refused(no_model, tmp_path):
    empty = tmp_path / "p.txt"
    empty.write_text("\n")
    one_line_error(run("validate", "--model", "tiny", "--prompt-file", str(empty)),
                   "the prompt is empty: give some text with --prompt or --prompt-file")


def test_engine_prompt_message_names_no_flag(tiny_engine):
    with pytest.raises(ValueError, match=r"^the prompt is empty: give some text$"):
        tiny_engine.encode_prompt("  ")


def test_engine_teacher_forced_counts_name_its_own_fields(tiny_engine):
    from tqbench.engine import teacher_forced_quality

    with pytest.raises(ValueError, match=r"^eval_tokens=0 is invalid: give at least 1 token$"):
        teacher_forced_quality(tiny_engine, "turbo4", corpus="bread", eval_tokens=0)


# ---- a fast preset table (item 15) ---------------------------------------------------------------------------
def test_policies_imports_no_transformers():
    code = ("import sys; from tqbench.cli import main\n"
            "try:\n    main(['--headless', 'policies', '--json'])\nexcept SystemExit:\n    pass\n"
            "print('LOADED' if 'transformers' in sys.modules else 'CLEAN', file=sys.stderr)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=900)
    assert out.returncode == 0, out.stderr
    assert out.stderr.strip().splitlines()[-1] == "CLEAN"
    assert json.loads(out.stdout)[0]["name"] == "fp16"


def test_default_geometry_without_transformers_equals_the_config_path():
    from tqbench.engine.cache.geometry import default_geometry, model_geometry

    assert default_geometry() == model_geometry("default").geometry


# ---- the clone's parent folder (item 13) -----------------------------------------------------------------------
def test_editable_install_puts_the_clone_root_on_sys_path():
    """``package-dir = {"" = "."}`` makes setuptools' editable install a static .pth of the clone's root."""
    assert read_toml(str(REPO / "pyproject.toml"), "pyproject")["tool"]["setuptools"]["package-dir"] == {"": "."}


def test_a_folder_named_tqbench_no_longer_shadows_the_package(tmp_path):
    """From the clone's parent folder ('' first on sys.path, holding a folder named tqbench without __init__.py),
    the package still imports once the clone's root is on sys.path, as the static .pth puts it."""
    (tmp_path / "tqbench").symlink_to(REPO, target_is_directory=True)
    code = f"import sys; sys.path.append({str(REPO)!r}); from tqbench import Engine, __version__; print(__version__)"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env,
                         timeout=900)
    assert out.returncode == 0, out.stderr
