import json
import subprocess
import sys

import pytest


def _run(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout


def test_engine_does_not_import_front_ends():
    out = _run(
        "import sys, tqbench.engine.engine, tqbench.engine.cache.tqcache, tqbench.engine.cache.fused;"
        "print(sorted(m for m in ('textual','rich','click','fastapi','starlette','uvicorn') if m in sys.modules))"
    )
    assert out.strip() == "[]"


#: imported in one subprocess, room by room: after each module, the front-end libraries it newly loaded
_HYGIENE = r"""
import json, os, pkgutil, sys
import tqbench

BACK = ("tqbench.constants", "tqbench.kernels", "tqbench.engine", "tqbench.sessions")
FRONT = ("tqbench.server", "tqbench.cli")
LIBS = ("textual", "rich", "click", "fastapi", "uvicorn", "starlette")


def modules(package):
    # every module of a package, found on disk (pkgutil.walk_packages would import the packages itself)
    yield package
    base = os.path.join(os.path.dirname(tqbench.__file__), *package.split(".")[1:])
    if os.path.isdir(base):
        for info in pkgutil.iter_modules([base]):
            yield from modules(f"{package}.{info.name}") if info.ispkg else [f"{package}.{info.name}"]


def loaded():
    return {lib for lib in LIBS if lib in sys.modules}


report = {}
for room in (*BACK, *FRONT):
    for name in modules(room):
        before = loaded()
        __import__(name)
        report[name] = sorted(loaded() - before)
print(json.dumps({"back": BACK, "report": report}))
"""


def test_every_module_imports_clean_of_front_end_libraries():
    """Engine, sessions and kernels modules load no front-end library; server and CLI modules (the
    workbench glue included: it imports the TUI lazily) load no Textual."""
    found = json.loads(_run(_HYGIENE))
    report = found["report"]
    assert any(m.startswith("tqbench.engine.") for m in report) and "tqbench.cli.workbench" in report
    back = {m: libs for m, libs in report.items() if m.startswith(tuple(found["back"])) and libs}
    assert back == {}, f"engine/sessions/kernels modules load front-end libraries: {back}"
    textual = [m for m, libs in report.items() if "textual" in libs]
    assert textual == [], f"these modules import textual at import time: {textual}"


def test_help_does_not_import_torch():
    out = _run(
        "import sys; from click.testing import CliRunner; from tqbench.cli import main;"
        "r = CliRunner().invoke(main, ['--help']); assert r.exit_code == 0, r.output;"
        "print('torch' in sys.modules)"
    )
    assert out.strip() == "False"


def cli(*args):
    """The real entry point (``python -m tqbench.cli``) in a subprocess: for what only a fresh process shows."""
    return subprocess.run([sys.executable, "-m", "tqbench.cli", *args], capture_output=True, text=True)


def cli_in_process(*args):
    """The same command through click's ``CliRunner`` in this process (no interpreter and torch start per call):
    exit code and the two streams, as ``cli`` gives them. An exception that escaped the CLI (which a subprocess
    would print as a traceback, exit 1) is re-raised here."""
    import types

    from click.testing import CliRunner

    from tqbench.cli import main

    r = CliRunner().invoke(main, list(args))
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        raise r.exception
    return types.SimpleNamespace(returncode=r.exit_code, stdout=r.stdout, stderr=r.stderr)


def test_version():
    r = cli("--version")
    assert r.returncode == 0 and "0.1.0" in r.stdout


def test_bench_json_on_tiny_model():
    r = cli("--headless", "bench", "--model", "tiny", "--kv-policy", "turbo4", "--max-new-tokens", "5",
            "--prompt", "hello there", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    for key in ("input_tokens", "output_tokens", "kv_policy", "elapsed_seconds", "tokens_per_second"):
        assert key in d
    rep = d["cache_report"]
    for key in ("compressed_storage_bytes", "dense_fp16_bytes", "memory_saved_pct", "compressed_at_rest_saved_pct",
                "active_decode_memory_saved_pct", "cache_mode", "bits_per_element"):
        assert key in rep
    assert d["output_tokens"] == 5
    assert sum(layer["total_bytes"] for layer in rep["layers"]) + rep["shared_bytes"] == rep["compressed_storage_bytes"]


def test_policies_json_lists_every_preset():
    from tqbench.engine.policy import PRESETS

    r = cli_in_process("--headless", "policies", "--json")
    rows = json.loads(r.stdout)
    from tqbench.engine.policy import ENGINE_PRESETS, shipped_policy_names

    assert [row["name"] for row in rows] == list(PRESETS) + [n for n in shipped_policy_names() if n not in PRESETS] \
        + list(ENGINE_PRESETS)
    q8 = next(row for row in rows if row["name"] == "llamacpp:q8_0/q4_0")
    assert q8["meaning"].startswith("llama.cpp -ctk q8_0 -ctv q4_0: the engine's own KV storage, bit-exact")
    assert q8["policy"] == "k=q8_0,v=q4_0" and q8["bits_per_element"] == 6.5
    fp16 = rows[0]
    assert fp16["bits_per_element"] == 16 and fp16["saved_pct"] == 0


@pytest.mark.parametrize("args, needle", [
    (["--kv-policy", "turbo9"], "unknown policy preset 'turbo9'"),
    (["--kv-policy", "k=turbo9"], "unknown K codec 'turbo9'"),
    (["--max-new-tokens", "0"], "ask for at least 1 token"),
    (["--max-new-tokens", "-3"], "ask for at least 1 token"),
    (["--prompt-file", "/nonexistent/prompt.txt"], "does not exist"),
    (["--prompt", "a", "--prompt-file", "x.txt"], "not both"),
    (["--cache-mode", "warp"], "'warp' is not one of"),
    (["--kv-policy", "kv=int8,protect=99"], "layer index 99 is out of range"),
])
def test_bench_bad_input_is_one_line_exit_2(args, needle):
    r = cli_in_process("--headless", "bench", "--model", "tiny", "--max-new-tokens", "2", *args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert needle in r.stderr
    assert "Traceback" not in r.stderr


def test_missing_local_model_is_clear():
    r = cli_in_process("--headless", "bench", "--model", "./no/such/folder", "--max-new-tokens", "2")
    assert r.returncode == 2 and "Traceback" not in r.stderr
