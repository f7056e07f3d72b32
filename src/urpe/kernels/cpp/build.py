"""Building and loading the C++ kernel: torch's extension tools, compiled once per machine.

The sources beside this file are compiled on first use with `torch.utils.cpp_extension.load`
(ninja and a C++ compiler; `-O3 -march=native` where the compiler takes it) into the urpe cache
(`urpe.files.cache_root() / "cpp-kernel" / <key>`), and loaded with `torch.ops.load_library`.
The key hashes the sources, the flags, torch's version, the Python version and this CPU's
instruction sets, so an edit, a new torch or another machine sharing the home directory builds
anew instead of loading a library built for something else. A build takes about 20 s on 2
cores; later processes only load the library (milliseconds). `make setup` builds it ahead
(`python -m urpe.kernels.cpp`).

Where the build cannot happen (no compiler, no ninja, a compiler error) or is switched off with
URPE_CPP_KERNEL=0, `unavailable()` says why: "auto" then runs the eager blockwise kernel
("fused") after one warning, and `backend="cpp"` raises with that reason. Nothing fails.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import sys
import threading
import warnings
from pathlib import Path

import torch

from ...files import atomic_write_text, cache_root

NAMESPACE = "urpe_cpp"  # torch.ops.urpe_cpp.forward / backward (fixed in library.cpp)
SOURCES = ("library.cpp", "forward.cpp", "backward.cpp", "gemm.cpp", "checks.cpp")
HEADERS = ("tile.h", "loops.h")
SWITCH = "URPE_CPP_KERNEL"  # "0" / "off": never build or load the kernel
VERBOSE = "URPE_CPP_VERBOSE"  # "1": show the compiler's output
HERE = Path(__file__).resolve().parent

_lock = threading.Lock()
# "reason": None once loaded, else why not; "error": in full; "threaded": see `threaded`
_state: dict[str, str | bool | None] = {}


def compile_flags(native: bool = True, openmp: bool = True) -> list[str]:
    """Flags for this compiler: optimised, vectorised row loops (`omp simd`), IEEE semantics
    kept (no -ffast-math: the kernel relies on exp(-inf) = 0 and on NaN propagating).

    native: tuned to this CPU. openmp: OpenMP for `at::parallel_for`, which is header-inline:
    without -fopenmp its `omp parallel` is ignored and the tiles run on one thread. With it the
    library shares torch's libgomp, already loaded under the same soname."""
    if sys.platform == "win32":
        return ["/O2", "/openmp"] if openmp else ["/O2"]
    flags = ["-O3", "-fopenmp" if openmp else "-fopenmp-simd", "-fno-math-errno",
             "-fno-trapping-math"]  # fmt: skip
    if native:
        machine = platform.machine().lower()
        flags.append("-march=native" if machine in ("x86_64", "amd64", "i686") else "-mcpu=native")
    return flags


# Tried in this order until one builds: tuned to this CPU, then portable code (a compiler that
# has no -march=native), then without OpenMP (Apple's clang has no -fopenmp: the tiles then run
# on one thread, and "auto" prefers the eager kernel, which uses torch's threads).
BUILDS = (dict(native=True, openmp=True), dict(native=False, openmp=True),
          dict(native=False, openmp=False))  # fmt: skip


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


def _library_file(directory: Path, name: str) -> Path:
    return directory / f"{name}{'.pyd' if sys.platform == 'win32' else '.so'}"  # torch's names


def _missing_tools() -> str | None:
    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available():
        return "ninja is not installed (pip install ninja)"
    compiler = os.environ.get("CXX", "cl" if sys.platform == "win32" else "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler: {compiler!r} is not on PATH (install g++ or clang, or set CXX)"
    return None


def _build_and_load(flags: list[str]) -> None:
    """Load the library built with these flags, building it first if the cache lacks it."""
    from torch.utils import cpp_extension

    key = build_key(flags)
    name = f"{NAMESPACE}_{key}"
    directory = cache_root() / "cpp-kernel" / key
    library = _library_file(directory, name)
    ready = directory / "ready"
    if ready.exists() and library.exists():
        torch.ops.load_library(str(library))
        return
    directory.mkdir(parents=True, exist_ok=True)
    print(
        f"urpe: compiling the C++ CPU attention kernel (once per machine, about 20 s) in "
        f"{directory}",
        file=sys.stderr,
        flush=True,
    )
    cpp_extension.load(
        name=name,
        sources=[str(HERE / source) for source in SOURCES],
        extra_cflags=flags,
        extra_ldflags=[flag for flag in flags if "openmp" in flag],
        extra_include_paths=[str(HERE)],
        build_directory=str(directory),
        is_python_module=False,
        verbose=os.environ.get(VERBOSE, "") == "1",
    )
    atomic_write_text(ready, f"{name}\n")  # later processes load without asking the toolchain


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[-1] if text else ''}"[:300]


def load() -> str | None:
    """Build (where needed) and load the kernel once per process; None when it is loaded,
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
            "uses the eager blockwise kernel ('fused') on the CPU instead, which gives the same "
            "results more slowly. It needs a C++ compiler and ninja at run time; `python -m "
            "urpe.kernels.cpp` builds it and prints the compiler's errors.",
            RuntimeWarning,
            stacklevel=3,
        )
    return reason


def _load_reason() -> str | None:
    if os.environ.get(SWITCH, "").strip().lower() in ("0", "off", "false", "no"):
        return f"switched off with {SWITCH}={os.environ[SWITCH]}"
    missing = _missing_tools()
    if missing is not None:
        return missing
    first_error = None
    for build in BUILDS:
        try:
            _build_and_load(compile_flags(**build))
            return None
        except Exception as error:  # noqa: BLE001 - the next, plainer build may work
            first_error = first_error or error
    _state["error"] = str(first_error)
    return f"the build failed: {_first_line(first_error)}"


def is_loaded() -> bool:
    """Whether the kernel is loaded in this process (never builds or loads it)."""
    return "reason" in _state and _state["reason"] is None


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


def main(argv: list[str] | None = None) -> int:
    """`python -m urpe.kernels.cpp`: build the kernel now and say whether it loads."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m urpe.kernels.cpp",
        description="Build urpe's C++ CPU attention kernel now (otherwise it is built on first "
        "use) and say whether it loads. It is cached under the urpe cache "
        f"({cache_root() / 'cpp-kernel'}) and rebuilt only when its sources, torch or the CPU "
        f"change. Without a C++ compiler or ninja, urpe runs its eager kernel instead. "
        f"{SWITCH}=0 switches the C++ kernel off.",
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
    print(f"urpe: the C++ kernel is ready ({torch.ops.urpe_cpp.gemm_route()} products, {threads})")
    return 0
