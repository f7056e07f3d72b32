"""Loading the C++ kernel: a packaged build, else a cached one, else one compiled now.

In order, the first that works:
1. **Packaged**: a platform wheel built with `make wheel` carries the compiled kernel
   (`packaged`); it loads where torch's version and C++ ABI are those it was built against.
   Where it does not fit, that is said once, on the line of the build that replaces it (or in
   the reason no kernel runs), not by every process that then loads the cached build.
2. **Cached**: a kernel compiled earlier on this machine, in the urpe cache
   (`urpe.files.cache_root() / "cpp-kernel" / <key>`, or $URPE_KERNEL_CACHE_DIR / <key>: a
   data cache moved elsewhere need not compile the kernel again). No compiler is needed to
   load it.
3. **Compiled now** with `torch.utils.cpp_extension` (ninja and a C++ compiler; `-O3
   -march=native` where the compiler takes it), about 20 s on 2 cores, said on one line.
   `make setup` does it ahead (`python -m urpe.kernels.cpp`). $URPE_CPP_TARGET names another
   CPU to tune for (`-march=haswell`: AVX2, for valgrind, which runs no AVX-512 code).
4. **None**: "auto" runs the eager blockwise kernel ("blockwise") after one warning that says why,
   and `backend="cpp"` raises with that reason. Also where URPE_CPP_KERNEL=0 switches it off.

The library is loaded twice over: as torch ops (`torch.ops.load_library`) and, the same file,
as a Python extension module whose functions skip the dispatcher (`entry.cpp`,
`python_entry`).

The key hashes the sources, the flags, torch's version, the Python version and this CPU's
instruction sets, so an edit, a new torch or another machine sharing the home directory builds
anew instead of loading a library built for something else. What can go wrong with a shared
cache is handled in `toolchain` (one builder at a time, killed builds, builds that hang) and
`verified` (a library is loaded only if it is the file its build wrote: a truncated one would
kill the process with SIGBUS).
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import platform
import shutil
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from ...files import cache_root
from .packaged import package_kernel, packaged_kernel, unsuitable, wheel_builds
from .toolchain import BuildError, BuildTimeout, build_lock, clear_stale_torch_lock, compile_library
from .verified import mismatch, read_record, write_record

NAMESPACE = "urpe_cpp"  # torch.ops.urpe_cpp.forward / backward (fixed in library.cpp)
HERE = Path(__file__).resolve().parent
SOURCES = tuple(sorted(path.name for path in HERE.glob("*.cpp")))
HEADERS = tuple(sorted(path.name for path in HERE.glob("*.h")))
SWITCH = "URPE_CPP_KERNEL"  # "0" / "off": never build or load the kernel
VERBOSE = "URPE_CPP_VERBOSE"  # "1": show the compiler's output
TIMEOUT = "URPE_CPP_BUILD_TIMEOUT"  # seconds a build may run, or be waited for (default 600)
TARGET = "URPE_CPP_TARGET"  # the CPU a tuned build is for: -march=<it> (default "native")
RECORD = "ready"  # beside a cached library: its size and hash (`verified`)

_lock = threading.Lock()
# "reason": None once loaded, else why not; "error": the build's error in full; "source" and
# "library": where the loaded kernel came from; "compiling": said once; "threaded": see
# `threaded`; "packaged": why the wheel's kernel does not fit ("" where there is none).
_state: dict[str, str | bool | None] = {}


def _print(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


_report: list[Callable[[str], None]] = [_print]


@contextmanager
def report_to(say: Callable[[str], None]) -> Iterator[None]:
    """Send the build's lines ("compiling ...", "waiting ...") to `say` instead of stderr: a
    progress bar's line writer, or a sweep worker's channel to its parent."""
    _report.append(say)
    try:
        yield
    finally:
        _report.remove(say)


def _say(message: str) -> None:
    _report[-1](message)


def compile_flags(native: bool = True, openmp: bool = True) -> list[str]:
    """Flags for this compiler: optimised, vectorised row loops (`omp simd`), IEEE semantics
    kept (no -ffast-math: the kernel relies on exp(-inf) = 0 and on NaN propagating).

    native: tuned to this CPU (or to the one $URPE_CPP_TARGET names). openmp: OpenMP for
    `at::parallel_for`, which is header-inline: without -fopenmp its `omp parallel` is ignored
    and the tiles run on one thread. With it the library shares torch's libgomp, already loaded
    under the same soname."""
    if sys.platform == "win32":
        return ["/O2", "/openmp"] if openmp else ["/O2"]
    flags = [
        "-O3",
        "-fopenmp" if openmp else "-fopenmp-simd",
        "-fno-math-errno",
        "-fno-trapping-math",
    ]
    if native:
        target = os.environ.get(TARGET, "").strip() or "native"
        machine = platform.machine().lower()
        x86 = machine in ("x86_64", "amd64", "i686")
        flags.append(f"-march={target}" if x86 else f"-mcpu={target}")
    return flags


# Tried in this order until one builds: tuned to this CPU, then portable code (a compiler that
# has no -march=native; also the packaged kernel's flags), then without OpenMP (Apple's clang
# has no -fopenmp: the tiles then run on one thread, and "auto" prefers the eager kernel, which
# uses torch's threads).
BUILDS = (
    dict(native=True, openmp=True),
    dict(native=False, openmp=True),
    dict(native=False, openmp=False),
)


def _cpu_features() -> str:
    """This CPU's instruction sets (Linux), so that a -march=native library is never loaded on
    another CPU."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def build_key(flags: list[str]) -> str:
    digest = hashlib.sha256()
    for name in (*SOURCES, *HEADERS):
        digest.update(name.encode())
        digest.update((HERE / name).read_bytes())
    for part in (
        *flags,
        torch.__version__,
        sys.version,
        platform.machine(),
        _cpu_features(),
        os.environ.get("CXX", ""),
    ):
        digest.update(part.encode())
    return digest.hexdigest()[:16]


KERNEL_CACHE = "URPE_KERNEL_CACHE_DIR"  # where compiled kernels are kept (module docstring)


def kernel_cache() -> Path:
    """The folder of compiled kernels: $URPE_KERNEL_CACHE_DIR, else the urpe cache's."""
    chosen = os.environ.get(KERNEL_CACHE, "").strip()
    return Path(chosen).expanduser() if chosen else cache_root() / "cpp-kernel"


def build_directory(flags: list[str]) -> Path:
    """Where the kernel built with these flags is cached."""
    return kernel_cache() / build_key(flags)


def _library_file(directory: Path, name: str) -> Path:
    return directory / f"{name}{'.pyd' if sys.platform == 'win32' else '.so'}"  # torch's names


def _timeout() -> float:
    value = os.environ.get(TIMEOUT, "").strip()
    try:
        return float(value) if value else 600.0
    except ValueError:
        raise ValueError(f"{TIMEOUT} must be a number of seconds, got {value!r}") from None


def _missing_tools() -> str | None:
    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available():
        return "ninja is not installed (pip install ninja)"
    compiler = os.environ.get("CXX", "cl" if sys.platform == "win32" else "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler: {compiler!r} is not on PATH (install g++ or clang, or set CXX)"
    return None


def _load_library(library: Path, source: str) -> None:
    torch.ops.load_library(str(library))
    _state.update(source=source, library=str(library))
    _ENTRY[:] = [_python_entry(library)]


# The loaded library as a Python extension module (entry.cpp), or None where it does not import
_ENTRY: list = []
ENTRY_MODULE = "urpe_cpp_entry"  # its PyInit_ name, whatever the file is called


def _python_entry(library: Path):
    """The library's Python entry: the same file, already loaded, imported as an extension
    module (its functions call the kernel without torch's dispatcher). None where that fails,
    and why is kept: every call then goes through torch.ops.urpe_cpp."""
    loader = importlib.machinery.ExtensionFileLoader(ENTRY_MODULE, str(library))
    spec = importlib.util.spec_from_file_location(ENTRY_MODULE, library, loader=loader)
    try:
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
    except Exception as error:  # noqa: BLE001 - the ops themselves are loaded
        _state["entry"] = _first_line(error)
        return None
    return module


def python_entry():
    """The loaded kernel's Python entry module (`forward_if_finite` without the dispatcher), or
    None where no kernel is loaded or its entry did not import (then `_state["entry"]` says
    why)."""
    if load() is not None or not _ENTRY:
        return None
    return _ENTRY[0]


def _load_packaged() -> str | None:
    """Load the wheel's kernel: None when loaded, "" when there is none, else why not."""
    found = packaged_kernel()
    if found is None:
        return ""
    library, record = found
    why = unsuitable(record, set(_cpu_features().split())) or mismatch(record, library)
    if why is not None:
        return why
    try:
        _load_library(library, "packaged")
    except Exception as error:  # noqa: BLE001 - a kernel built here may still load
        return f"it does not load: {_first_line(error)}"
    return None


def _load_cached(flags: list[str]) -> str | None:
    """Load the cached build for these flags without a compiler: None when loaded, "" when
    there is none, else why it cannot be used (a build compiles it again)."""
    directory = build_directory(flags)
    record = read_record(directory / RECORD)
    if record is None:
        return ""
    why = mismatch(record, directory / record["library"])
    if why is not None:
        return f"the cached build is unusable: {why}"
    try:
        _load_library(directory / record["library"], "cache")
    except Exception as error:  # noqa: BLE001 - compiling it again may mend it
        return f"the cached build does not load ({_first_line(error)})"
    return None


def _build_and_load(flags: list[str]) -> None:
    """Compile the library for these flags into the cache (one process at a time), record it,
    and load it. Raises on a compiler error, BuildTimeout after the time allowed."""
    key = build_key(flags)
    name = f"{NAMESPACE}_{key}"
    directory = build_directory(flags)
    library = _library_file(directory, name)
    timeout = _timeout()

    def waiting(who: str) -> None:
        who = who or f"lock {directory}.lock"
        _say(
            f"urpe: waiting for another process to finish compiling the C++ CPU kernel "
            f"({who}; at most {timeout:.0f} s)"
        )

    with build_lock(directory.parent / f"{key}.lock", timeout, waiting):
        if _load_cached(flags) is None:  # built by the process waited for
            return
        directory.mkdir(parents=True, exist_ok=True)
        clear_stale_torch_lock(directory)  # left by a build that was killed: we hold the lock
        for unverified in (directory / RECORD, library):
            unverified.unlink(missing_ok=True)  # relinked, never trusted without a record
        if "compiling" not in _state:
            _state["compiling"] = str(directory)
            note = _packaged_note()
            _say(
                f"urpe: compiling the C++ CPU attention kernel (once per machine, about 20 s) "
                f"in {directory}" + (f" ({note})" if note else "")
            )
        try:
            _compile_sources(name, flags, directory, timeout)
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)  # the next build starts clean
            raise
        write_record(directory / RECORD, library, flags=flags, torch=torch.__version__)
        _load_library(library, "built")


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[-1] if text else ''}"[:300]


def load() -> str | None:
    """Load the kernel once per process (building it where needed); None when it is loaded,
    else why it is not (then, once per process, a warning says so)."""
    if "reason" in _state:
        return _state["reason"]
    with _lock:
        if "reason" in _state:
            return _state["reason"]
        reason = _load_reason()
        _state["reason"] = reason
    if reason is not None and not reason.startswith(f"switched off with {SWITCH}"):
        warnings.warn(
            f"urpe: the C++ CPU attention kernel is unavailable ({reason}); backend='auto' "
            "uses the eager blockwise kernel ('blockwise') on the CPU instead, which gives the "
            "same results more slowly. It needs a C++ compiler and ninja at run time; `python -m "
            "urpe.kernels.cpp` builds it and prints the compiler's errors.",
            RuntimeWarning,
            stacklevel=3,
        )
    return reason


def adopt(reason: str | None) -> None:
    """Take another process's finding that the kernel is unavailable, without a warning of
    this process's own: a sweep's workers after their parent tried (and said why once)."""
    if reason is not None:
        with _lock:
            _state.setdefault("reason", reason)


def is_loaded() -> bool:
    """Whether the kernel is loaded in this process (never builds or loads it)."""
    return "reason" in _state and _state["reason"] is None


def loaded() -> dict[str, str] | None:
    """Where the loaded kernel came from ("source": packaged, cache or built; "library": its
    file), or None where none is loaded."""
    if load() is not None:
        return None
    return {"source": str(_state["source"]), "library": str(_state["library"])}


def _load_reason() -> str | None:
    if os.environ.get(SWITCH, "").strip().lower() in ("0", "off", "false", "no"):
        return f"switched off with {SWITCH}={os.environ[SWITCH]}"
    packaged = _load_packaged()
    if packaged is None:
        return None
    # Why the wheel's kernel does not fit is said only where it matters: when a kernel is
    # compiled instead (once per machine), or in the reason none runs. A cached build, which
    # every later process loads, loads quietly.
    _state["packaged"] = packaged
    unusable = ""
    for build in BUILDS:  # a good build in the cache needs no compiler
        cached = _load_cached(compile_flags(**build))
        if cached is None:
            return None
        unusable = unusable or cached
    missing = _missing_tools()
    if missing is not None:
        return _and_packaged(f"{missing}; {unusable}" if unusable else missing)
    first_error = None
    for build in BUILDS:
        try:
            _build_and_load(compile_flags(**build))
            return None
        except BuildTimeout as error:  # the next build would wait or hang as long
            _state["error"] = str(error)
            return _and_packaged(str(error))
        except Exception as error:  # noqa: BLE001 - the next, plainer build may work
            first_error = first_error or error
    _state["error"] = getattr(first_error, "details", "") or str(first_error)
    said = str(first_error) if isinstance(first_error, BuildError) else _first_line(first_error)
    return _and_packaged(f"the build failed: {said}")


def _packaged_note() -> str:
    """Why the kernel packaged with urpe is not used here ("" where there is none)."""
    why = _state.get("packaged")
    return f"the kernel packaged with urpe does not fit here: {why}" if why else ""


def _and_packaged(reason: str) -> str:
    note = _packaged_note()
    return f"{reason}; {note}" if note else reason


def _constant_for_compile(fn):
    """`torch.compiler.assume_constant_result(fn)`: torch.compile calls fn while tracing and
    keeps its answer as a constant, instead of tracing into file checks and a build. That call
    imports torch._dynamo (about a second at urpe's import) only to set one attribute on fn;
    where nothing has imported Dynamo yet, the attribute is set here."""
    if "torch._dynamo" in sys.modules:
        return torch.compiler.assume_constant_result(fn)
    fn._dynamo_marked_constant = True
    return fn


@_constant_for_compile
def unavailable() -> str | None:
    """Why the C++ kernel cannot run here (None: it is loaded). Builds it on the first call.

    A constant for torch.compile: the answer is fixed for the life of the process."""
    return load()


@_constant_for_compile
def threaded() -> bool:
    """Whether the loaded kernel spreads its tiles over torch's threads (built with OpenMP)."""
    if "threaded" not in _state:  # fixed for the loaded library; asked on every CPU call
        _state["threaded"] = load() is None and bool(torch.ops.urpe_cpp.threaded())
    return _state["threaded"]


def _compile_sources(name: str, flags: list[str], directory: Path, timeout: float) -> None:
    """Compile and link this folder's sources into `directory/<name>.so` (URPE_CPP_VERBOSE=1:
    with the compiler's commands)."""
    verbose = os.environ.get(VERBOSE, "") == "1"
    compile_library(
        name, [str(HERE / s) for s in SOURCES], flags, [str(HERE)], directory, timeout, verbose
    )


def build_for_wheel(target: Path) -> Path:
    """Compile the kernel for a platform wheel into `target/packaged` (`target`: the wheel's
    copy of this folder) with portable flags (`packaged.wheel_builds`); returns the library.
    `setup.py` calls it."""

    def compile_into(flags: list[str], scratch: Path, name: str) -> Path:
        directory = scratch / hashlib.sha256(" ".join(flags).encode()).hexdigest()[:16]
        directory.mkdir(parents=True)
        _compile_sources(name, flags, directory, _timeout())
        return _library_file(directory, name)

    portable = [compile_flags(**build) for build in BUILDS if not build["native"]]
    return package_kernel(target, wheel_builds(portable), compile_into)


def main(argv: list[str] | None = None) -> int:
    """`python -m urpe.kernels.cpp`: build the kernel now and say whether it loads."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m urpe.kernels.cpp",
        description="Build urpe's C++ CPU attention kernel now (otherwise it is built on first "
        "use) and say whether it loads. A kernel packaged in urpe's wheel is used where it "
        "fits this torch; otherwise it is compiled once and cached under the urpe cache "
        f"({kernel_cache()}), and rebuilt only when its sources, torch or the CPU "
        f"change. Without a C++ compiler or ninja, urpe runs its eager kernel instead. "
        f"{SWITCH}=0 switches the C++ kernel off; {TIMEOUT} (seconds, default 600) bounds a "
        "build and the wait for another process's build.",
    )
    parser.add_argument("--verbose", action="store_true", help="show the compiler's commands")
    if parser.parse_args(argv).verbose:
        os.environ[VERBOSE] = "1"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reason = load()
    if reason is not None:
        details = _state.get("error")
        print(f"urpe: the C++ kernel is unavailable: {reason}", file=sys.stderr)
        if details:
            print(details, file=sys.stderr)
        return 1
    threads = "torch's threads" if threaded() else "one thread (built without OpenMP)"
    where = {"packaged": "packaged with urpe", "cache": "cached", "built": "built now"}
    entry = (
        ""
        if python_entry()
        else f"; no Python entry (calls go through torch.ops): {_state['entry']}"
    )
    print(
        f"urpe: the C++ kernel is ready ({where[str(_state['source'])]}: {_state['library']}; "
        f"{torch.ops.urpe_cpp.gemm_route()} products, {threads}{entry})"
    )
    return 0
