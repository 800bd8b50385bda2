"""The native CPU kernel of the ``fused`` cache mode: C++ built on first use (or by ``make setup``).

``fused_attention.cpp`` (one translation unit over its internal ``fa_*.h`` headers) attends straight from the
packed codes and quantizes + packs new TurboQuant rows (the append path; see its header); it is compiled with torch's
extension tools for the CPU it runs on (``-march=native``; the build is cached per CPU-flag set and
source hash under ``~/.cache/torch_extensions``, or ``TORCH_EXTENSIONS_DIR``) and threaded with torch's own pool.

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
import threading
import time
import warnings
from pathlib import Path

__all__ = ["DISABLE_ENV", "ISA_ENV", "NativeUnavailable", "cflags", "native_module", "native_status", "wait_for_build_lock"]

DISABLE_ENV = "TQBENCH_NATIVE"  # "0" turns the native kernel off (the torch reference runs, and says so)
SOURCE = Path(__file__).with_name("fused_attention.cpp")  # the one translation unit; it includes the headers
#: every C++ file of the kernel (the .cpp and its internal ``fa_*.h`` headers): all hashed and copied
SOURCES = (SOURCE, *sorted(SOURCE.parent.glob("fa_*.h")))
ISA_ENV = "TQBENCH_NATIVE_ISA"  # "avx2" / "generic": build without AVX-512 (/ without AVX2 too); unset: the CPU's best
CFLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-ffp-contract=fast", "-fno-math-errno"]
_ISA_FLAGS = {"": [], "native": [], "avx2": ["-mno-avx512f"], "generic": ["-mno-avx512f", "-mno-avx2", "-mno-fma"]}

#: a build lock in a build folder where nothing has changed for this long was left by a killed build (a build
#: writes its object file within a few minutes even on a loaded 2-core machine)
STALE_LOCK_SECONDS = 900
#: after this long waiting on another process's build lock, say so (once)
WAIT_WARN_SECONDS = 30

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


def _build():
    if os.environ.get(DISABLE_ENV, "").strip() == "0":
        raise NativeUnavailable(f"{DISABLE_ENV}=0")
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        raise NativeUnavailable(f"no C++ compiler ({cxx} not found: install g++ to build the native kernel)")
    import sys

    bindir = os.path.dirname(sys.executable)  # the venv's ninja (a dependency) when the venv is not activated
    if bindir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    try:
        from torch.utils.cpp_extension import load
    except Exception as exc:  # pragma: no cover - torch always ships it
        raise NativeUnavailable(f"torch.utils.cpp_extension unavailable: {exc}") from exc
    flags = cflags()
    name = f"tqbench_fused_cpu_{_cpu_tag()}_{_source_tag(flags)}"
    try:
        from torch.utils.cpp_extension import _get_build_directory

        build_dir = Path(_get_build_directory(name, verbose=False))
        wait_for_build_lock(build_dir)
        source = _stable_source(build_dir)
        return load(name=name, sources=[str(source)], extra_cflags=flags, extra_ldflags=["-fopenmp"], verbose=False)
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


def wait_for_build_lock(build_dir: Path, stale_after: float = STALE_LOCK_SECONDS, poll: float = 1.0) -> str | None:
    """Wait while another process holds the build lock (torch's ``lock`` file, which torch itself waits on
    forever); a lock in a folder where nothing has changed for ``stale_after`` seconds is left over from a killed
    build and is removed. Returns what was done about a stale lock, or None."""
    lock = build_dir / "lock"
    start, warned = time.monotonic(), False
    while lock.exists():
        try:
            newest = max(p.stat().st_mtime for p in build_dir.iterdir())
        except (FileNotFoundError, ValueError):  # the build finished (or the folder went) while we looked
            continue
        if time.time() - newest > stale_after:
            try:
                lock.unlink()
            except FileNotFoundError:
                pass
            note = (f"removed a stale native-kernel build lock {lock}: nothing in its folder changed for "
                    f"{stale_after:.0f} s (a killed build left it)")
            warnings.warn(note, stacklevel=2)
            return note
        if not warned and time.monotonic() - start > WAIT_WARN_SECONDS:
            warnings.warn(f"waiting for another process's native-kernel build ({lock}); a build takes about a "
                          "minute on 2 cores. If no tqbench process is running, delete that file", stacklevel=2)
            warned = True
        time.sleep(poll)
    return None


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
    try:
        native_module()
    except NativeUnavailable as exc:
        return False, str(exc)
    return True, f"native CPU kernel (C++, -march=native, {native_module().rules()['isa']})"
