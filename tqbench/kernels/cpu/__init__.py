"""The native CPU kernel of the ``fused`` cache mode: C++ built on first use (or by ``make setup``).

``fused_attention.cpp`` (one translation unit over its internal ``fa_*.h`` headers) attends straight from the
packed codes and quantizes + packs new TurboQuant rows (the append path; see its header); it is compiled with
torch's extension tools for the CPU it runs on (``-march=native``; the build is cached per CPU-flag set, install
(torch, interpreter) and source hash under ``~/.cache/torch_extensions``, or ``TORCH_EXTENSIONS_DIR``) and threaded
with torch's own pool. Builders hold an OS lock on their build folder (``builder_lock``), so a build killed
mid-way never blocks the next one: its leftover torch lock is removed at once.

``TQBENCH_NATIVE_ISA=avx2`` builds without AVX-512 (the AVX2 paths; tests force it to cover CPUs without
AVX-512), ``=generic`` without either; the default is the CPU's best. ``native_status()`` says whether it can run
and why not (no compiler, a failed build, ``TQBENCH_NATIVE=0``);
``native_module()`` returns the loaded module or raises ``NativeUnavailable`` with that reason. The first
call in a process pays the build (about a minute on 2 cores) or the cached load (milliseconds).
Run ``python -m tqbench.kernels.cpu`` to build it ahead of time and print the status.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tqbench.kernels.pidlock import pid_lock

__all__ = ["BUILDER_LOCK", "DISABLE_ENV", "ISA_ENV", "NativeUnavailable", "build_name", "builder_lock", "cflags",
           "native_module", "native_status"]

DISABLE_ENV = "TQBENCH_NATIVE"  # "0" turns the native kernel off (the torch reference runs, and says so)
SOURCE = Path(__file__).with_name("fused_attention.cpp")  # the one translation unit; it includes the headers
#: every C++ file of the kernel (the .cpp and its internal ``fa_*.h`` headers): all hashed and copied
SOURCES = (SOURCE, *sorted(SOURCE.parent.glob("fa_*.h")))
ISA_ENV = "TQBENCH_NATIVE_ISA"  # "avx2" / "generic": build without AVX-512 (/ without AVX2 too); unset: the CPU's best
CFLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-ffp-contract=fast", "-fno-math-errno"]
_ISA_FLAGS = {"": [], "native": [], "avx2": ["-mno-avx512f"], "generic": ["-mno-avx512f", "-mno-avx2", "-mno-fma"]}

#: our own lock file in a build folder: every tqbench builder holds an OS lock (``flock``) on it for the whole
#: time it builds or loads there, so torch's ``lock`` file only ever exists while a live process holds this one
#: (the OS drops a ``flock`` when its process dies, however it dies)
BUILDER_LOCK = "tqbench-builder.lock"

_lock = threading.Lock()
_state: dict = {}


class NativeUnavailable(RuntimeError):
    """The native kernel cannot run here; the message says why and what to do."""


def _cpu_tag() -> str:
    """A short hash of this CPU's feature flags: a build for one CPU is never loaded on another."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = line
                break
    except OSError:
        pass
    import platform

    return hashlib.sha1(f"{platform.machine()} {flags}".encode()).hexdigest()[:10]


def cflags() -> list[str]:
    """The compiler flags of this process's build (``TQBENCH_NATIVE_ISA`` picks the instruction set)."""
    isa = os.environ.get(ISA_ENV, "").strip().lower()
    if isa not in _ISA_FLAGS:
        raise NativeUnavailable(f"{ISA_ENV}={isa!r} is not an instruction-set choice: use avx2, generic or leave it unset")
    return CFLAGS + _ISA_FLAGS[isa]


def _source_tag(flags: list[str]) -> str:
    """A short hash of every source file (names and bytes) and the flags: checkouts with different kernels never
    share (or overwrite) a build, and editing a header rebuilds."""
    h = hashlib.sha1()
    for src in SOURCES:
        h.update(src.name.encode() + b"\0" + src.read_bytes() + b"\0")
    h.update(" ".join(flags).encode())
    return h.hexdigest()[:8]


def _install_tag() -> str:
    """A short hash of this install (torch's folder and version, the interpreter and its prefix): each venv writes
    its own include paths into build.ninja, so two installs sharing one build folder would rebuild it in turn."""
    import torch

    where = f"{os.path.dirname(os.path.abspath(torch.__file__))}|{torch.__version__}|{sys.prefix}|{sys.executable}"
    return hashlib.sha1(where.encode()).hexdigest()[:8]


def build_name(flags: list[str]) -> str:
    """The extension's name, which names its build folder: one per CPU-flag set, install, and source + flags."""
    return f"tqbench_fused_cpu_{_cpu_tag()}_{_install_tag()}_{_source_tag(flags)}"


def _build():
    if os.environ.get(DISABLE_ENV, "").strip() == "0":
        raise NativeUnavailable(f"{DISABLE_ENV}=0")
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        raise NativeUnavailable(f"no C++ compiler ({cxx} not found: install g++ to build the native kernel)")
    bindir = os.path.dirname(sys.executable)  # the venv's ninja (a dependency) when the venv is not activated
    if bindir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    try:
        from torch.utils.cpp_extension import load
    except Exception as exc:  # pragma: no cover - torch always ships it
        raise NativeUnavailable(f"torch.utils.cpp_extension unavailable: {exc}") from exc
    flags = cflags()
    name = build_name(flags)
    try:
        from torch.utils.cpp_extension import _get_build_directory

        build_dir = Path(_get_build_directory(name, verbose=False))
        with builder_lock(build_dir):
            source = _stable_source(build_dir)
            return load(name=name, sources=[str(source)], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                        verbose=False)
    except Exception as exc:
        first = next((ln for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)
        raise NativeUnavailable(f"the native kernel failed to build: {first[:300]}") from exc


def _stable_source(build_dir: Path) -> Path:
    """The sources as files inside their build folder (the .cpp and every header it includes): every checkout of
    the same source (worktrees, a fresh clone) then gives ninja the same command, so they share one build instead
    of rebuilding it in turn. Returns the .cpp's copy."""
    for src in SOURCES:
        dest = build_dir / src.name
        data = src.read_bytes()
        if not dest.is_file() or dest.read_bytes() != data:
            tmp = build_dir / f".{src.name}.{os.getpid()}.tmp"
            tmp.write_bytes(data)
            os.replace(tmp, dest)
    return build_dir / SOURCE.name


@contextmanager
def builder_lock(build_dir: Path) -> Iterator[str | None]:
    """Hold the builders' OS lock on ``build_dir`` for the block (build or load inside it; ``pidlock.pid_lock``).

    While another live process holds it, wait (saying so once, with its pid). Once held, a torch ``lock`` file in
    the folder cannot belong to a live build (every tqbench builder holds this lock while torch's exists): it was
    left by a killed build, so it is removed at once, with a warning. Yields what was done about a stale lock, or
    None. Where the OS has no ``flock`` (Windows), nothing is held and torch's own wait applies.
    """

    def waiting(pid: str) -> None:
        warnings.warn(f"waiting for another process's native-kernel build in {build_dir} (pid {pid}); a "
                      "build takes about a minute on 2 cores", stacklevel=6)

    with pid_lock(build_dir / BUILDER_LOCK, waiting) as held:
        note = None
        lock = build_dir / "lock"
        if held and lock.exists():
            try:
                lock.unlink()
            except FileNotFoundError:
                pass
            note = (f"removed a stale native-kernel build lock {lock}: no tqbench builder holds its folder (a killed "
                    "build left it)")
            warnings.warn(note, stacklevel=3)
        yield note


def native_module():
    """The built extension (built or loaded once per process), or ``NativeUnavailable`` saying why."""
    with _lock:
        if "module" not in _state and "error" not in _state:
            try:
                _state["module"] = _build()
            except NativeUnavailable as exc:
                _state["error"] = exc
        if "error" in _state:
            raise _state["error"]
        return _state["module"]


def native_status() -> tuple[bool, str]:
    """``(usable, why)``; builds or loads the kernel the first time it is asked."""
    status = _state.get("status")  # (asked by every fused call: answered once per process)
    if status is None:
        try:
            mod = native_module()
        except NativeUnavailable as exc:
            return False, str(exc)
        status = _state["status"] = (True, f"native CPU kernel (C++, -march=native, {mod.rules()['isa']})")
    return status
