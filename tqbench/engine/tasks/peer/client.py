"""The tqbench side of a peer run: where the peer's Python is, the request (the suite's own token ids and cut
points), the subprocess and its JSON lines. Torch-free to import; never imports kvpress."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

from tqbench.engine.events import CancelFlag, OnEvent, Progress, emit
from tqbench.engine.request import RequestError

PEERS = ("kvpress",)
#: kvpress presses the runner knows (``kvpress_runner._press_factories``), the default set first
PRESSES = ("snapkv", "tova", "kvzip", "expected", "knorm", "chunkkv", "adakv", "streaming", "none")
DEFAULT_PRESSES = ("snapkv", "tova", "kvzip", "expected", "knorm", "chunkkv")
ENV_VAR = "TQBENCH_KVPRESS_PYTHON"
VENV = ".venv-kvpress"
HINT = (f"run `make kvpress-env` in the tqbench checkout (creates {VENV}: CPU torch, transformers<5.3, kvpress), "
        f"or set {ENV_VAR} to a Python that has kvpress")
RUNNER = Path(__file__).with_name("kvpress_runner.py")
PROTOCOL_VERSION = 1


class PeerMissingError(ValueError):
    """The peer's environment is not there: the one line says the command that creates it."""


class PeerError(RuntimeError):
    """The peer ran and failed: its own one-line message."""


def check_presses(value) -> tuple[str, ...]:
    """A comma list (or list) of ``PRESSES`` names; None: ``DEFAULT_PRESSES``."""
    if value is None:
        return DEFAULT_PRESSES
    items = [p.strip().lower() for p in (value.split(",") if isinstance(value, str) else value) if p.strip()]
    bad = [p for p in items if p not in PRESSES]
    if bad or not items:
        raise RequestError("peer_presses", value, f"choose from {', '.join(PRESSES)}")
    return tuple(dict.fromkeys(items))


def check_ratios(value) -> tuple[float, ...]:
    """kvpress compression ratios (the fraction removed, tqbench's ``keep=1-r``): a comma list, each 0 < r < 1."""
    items = value.split(",") if isinstance(value, str) else list(value)
    try:
        ratios = tuple(float(r) for r in items if str(r).strip())
    except ValueError:
        ratios = ()
    if not ratios or not all(0 < r < 1 for r in ratios):
        raise RequestError("peer_ratios", value, "give compression ratios 0 < r < 1 (the fraction removed, "
                                                  "e.g. 0.25,0.5,0.75,0.875)")
    return tuple(dict.fromkeys(ratios))


def _has_kvpress(python: Path) -> bool:
    """True when ``python``'s environment holds kvpress, found by its files (no interpreter started)."""
    lib = python.absolute().parent.parent / "lib"
    return any(lib.glob("python3*/site-packages/kvpress/__init__.py"))


def peer_python(peer: str = "kvpress", roots: list[Path] | None = None) -> Path:
    """The Python that runs the peer: ``$TQBENCH_KVPRESS_PYTHON``, else ``.venv-kvpress`` in one of ``roots``
    (default: the working folder, then the checkout tqbench runs from). Raises ``PeerMissingError`` (one line: the
    command that creates it)."""
    if peer not in PEERS:
        raise RequestError("peer", peer, f"choose from {', '.join(PEERS)}")
    env = os.environ.get(ENV_VAR)
    if env:
        p = Path(env).expanduser()
        if not (p.is_file() and os.access(p, os.X_OK)):
            raise PeerMissingError(f"{ENV_VAR}={env} is not an executable Python: {HINT}")
        return p
    roots = [Path.cwd(), Path(__file__).resolve().parents[4]] if roots is None else roots
    for root in roots:
        p = root / VENV / "bin" / "python"
        if p.is_file() and _has_kvpress(p):
            return p
    raise PeerMissingError(f"kvpress is not installed beside tqbench (no {VENV} with kvpress in "
                           f"{' or '.join(dict.fromkeys(str(r) for r in roots))}): {HINT}")


def model_folder(engine) -> str:
    """The weights the peer loads: the model's folder on disk (a GGUF model's converted float32 folder, which
    tqbench itself loaded), so both sides read the same weights."""
    src = engine.loaded.source
    if src.gguf_file:
        from tqbench.engine.models.gguf import converted_dir

        folder = converted_dir(src)
    elif src.kind == "local":
        folder = Path(src.path_or_id)
    else:
        raise RequestError("model", engine.name, "the peer needs a model on disk: give a GGUF file, a local folder "
                                                 "or the default model")
    if not (folder / "config.json").is_file():
        raise RequestError("model", engine.name, f"{folder} has no config.json for the peer to load")
    return str(folder)


def build_request(engine, suite, presses, ratios, protocols, threads: int | None = None) -> dict:
    """The runner's request for ``suite``'s samples (``tasks.SuiteBaseline``): the same token ids, cut where the
    question starts (agnostic) or where the user's turn ends (aware)."""
    from tqbench.engine.tasks.generate import question_start, user_turn_end
    from tqbench.engine.tasks.spec import TASKS

    cuts = {"agnostic": question_start, "aware": user_turn_end}
    samples = [{"id": f"{s.task}#{s.index}", "ids": [int(t) for t in s.ids[0].tolist()],
                "cuts": {p: cuts[p](engine, s) for p in protocols},
                "max_new_tokens": TASKS[s.task].max_new_tokens} for s in suite.samples]
    return {"version": PROTOCOL_VERSION, "model": model_folder(engine),
            "dtype": str(engine.loaded.dtype).removeprefix("torch."), "threads": threads or engine.loaded.threads,
            "presses": list(presses), "ratios": [float(r) for r in ratios], "protocols": list(protocols),
            "samples": samples}


def run_peer(request: dict, python: Path | None = None, *, on_event: OnEvent | None = None,
             cancel: CancelFlag | None = None) -> dict:
    """Run the peer on ``request``; its progress lines become ``Progress("peer", ...)`` events. Returns its result
    (``answers``, ``versions``); raises ``PeerError`` with the peer's own message when it fails."""
    python = python or peer_python()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}  # the peer's own site-packages only
    env.setdefault("OMP_NUM_THREADS", str(request.get("threads", 1)))
    with tempfile.TemporaryFile("w+", encoding="utf-8") as err:
        proc = subprocess.Popen([str(python), "-I", str(RUNNER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=err, text=True, env=env)
        result = error = None
        try:
            proc.stdin.write(json.dumps(request))
            proc.stdin.close()
            for line in proc.stdout:
                if cancel is not None and cancel():
                    proc.kill()
                    break
                try:
                    msg = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a library's stray print, not the protocol
                kind = msg.get("event") if isinstance(msg, dict) else None
                if kind == "progress":
                    emit(on_event, Progress("peer", msg.get("done", 0), msg.get("total"), msg.get("what", "")))
                elif kind == "result":
                    result = msg
                elif kind == "error":
                    error = str(msg.get("message", "failed"))
        finally:
            code = proc.wait()
        from tqbench.engine.events import raise_if_cancelled

        raise_if_cancelled(cancel, "peer")
        if result is None or code != 0:
            err.seek(0)
            tail = [ln for ln in err.read().splitlines() if ln.strip()][-1:]
            why = error or (tail[0] if tail else f"exit status {code}")
            raise PeerError(f"the kvpress peer ({python}) failed: {why}")
    if result.get("version") != PROTOCOL_VERSION:
        raise PeerError(f"the kvpress peer answered protocol version {result.get('version')!r}, expected "
                        f"{PROTOCOL_VERSION}")
    return result


__all__ = ["DEFAULT_PRESSES", "ENV_VAR", "HINT", "PEERS", "PRESSES", "PeerError", "PeerMissingError",
           "build_request", "check_presses", "check_ratios", "model_folder", "peer_python", "run_peer"]
