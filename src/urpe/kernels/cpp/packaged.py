"""The kernel compiled into a platform wheel (`make wheel`), loaded where it fits.

A wheel built with URPE_BUILD_KERNEL=1 carries `packaged/urpe_cpp.so` beside the sources, with
`packaged/kernel.json`: the library's size and SHA-256 (checked before loading, as for a cached
build) and what it was built against. A C++ extension links torch's C++ API, which has no stable
ABI: the library is loaded only under the same torch version, C++ ABI, Python version and
machine type; anywhere else urpe uses a kernel built on this machine (see `build`).

It is compiled without -march=native (the machine that builds the wheel is not the one that
runs it). On x86-64 it targets x86-64-v3 (AVX2 and FMA: Intel since 2013, AMD since 2015),
which runs about as fast as a -march=native build on an AVX-512 machine where the baseline (SSE2)
build takes twice as long (fwd+bwd, L=2048); its record lists those instruction sets and it is
not loaded on a CPU without one of them. The matrix products go to torch's BLAS, which picks
the CPU's best routine at run time either way.
"""

from __future__ import annotations

import platform
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from .verified import read_record, write_record

HERE = Path(__file__).resolve().parent
DIRECTORY = "packaged"
RECORD = "kernel.json"
LIBRARY = "urpe_cpp"
# -march=x86-64-v3 and the instruction sets it assumes, as /proc/cpuinfo names them.
X86_64_V3 = (
    "-march=x86-64-v3",
    (
        "abm",
        "avx",
        "avx2",
        "bmi1",
        "bmi2",
        "cx16",
        "f16c",
        "fma",
        "lahf_lm",
        "movbe",
        "pni",
        "popcnt",
        "sse4_1",
        "sse4_2",
        "ssse3",
        "xsave",
    ),
)


def this_torch() -> dict[str, Any]:
    """What a packaged library must have been built against to load here."""
    return {
        "torch": torch.__version__,
        "cxx11_abi": bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True)),
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "machine": platform.machine().lower(),
        "platform": sys.platform,
    }


def packaged_kernel(root: Path = HERE) -> tuple[Path, dict[str, Any]] | None:
    """The packaged library and its record, or None where this install has none (an editable
    install, a wheel built without URPE_BUILD_KERNEL=1)."""
    record = read_record(root / DIRECTORY / RECORD)
    if record is None:
        return None
    return root / DIRECTORY / record["library"], record


def unsuitable(record: dict[str, Any], cpu_features: set[str]) -> str | None:
    """Why a packaged library cannot load here (None: it can); `cpu_features`: this CPU's
    instruction sets."""
    for fact, value in this_torch().items():
        if record.get(fact) != value:
            return f"built for {fact} {record.get(fact)}; this is {value}"
    lacking = sorted(set(record.get("cpu_features", ())) - cpu_features)
    if lacking:
        return f"built for CPUs with {', '.join(lacking)}, which this one lacks"
    return None


def wheel_builds(portable: list[list[str]]) -> list[tuple[list[str], tuple[str, ...]]]:
    """(flags, instruction sets the library needs) for a wheel, best first: x86-64-v3 where
    the architecture is x86-64 and the compiler takes -march, then the `portable` flag sets."""
    machine = platform.machine().lower()
    builds = [(flags, ()) for flags in portable]
    if machine in ("x86_64", "amd64") and sys.platform != "win32":
        march, needs = X86_64_V3
        builds = [([*flags, march], needs) for flags in portable] + builds
    return builds


def package_kernel(
    target: Path, builds: list[tuple[list[str], tuple[str, ...]]], compile_into
) -> Path:
    """Compile the kernel for a wheel into `target/packaged/`: the first of `builds` (flags,
    instruction sets needed; never -march=native) that compiles, by `compile_into(flags,
    directory, name)`. Returns the library."""
    destination = target / DIRECTORY
    destination.mkdir(parents=True, exist_ok=True)
    errors = []
    with tempfile.TemporaryDirectory(prefix="urpe-wheel-kernel-") as scratch:
        for flags, needs in builds:
            if any("native" in flag for flag in flags):
                raise ValueError(f"a packaged kernel must run on other machines: {flags}")
            try:
                built = compile_into(flags, Path(scratch), LIBRARY)
            except Exception as error:  # noqa: BLE001 - the next, plainer flag set may build
                errors.append(f"{' '.join(flags)}: {error}")
                continue
            library = destination / built.name
            shutil.copyfile(built, library)
            write_record(
                destination / RECORD, library, flags=flags, cpu_features=list(needs), **this_torch()
            )
            return library
    raise RuntimeError("the packaged C++ kernel did not build:\n" + "\n".join(errors))
