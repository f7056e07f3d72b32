"""The kernel compiled into a platform wheel (`make wheel`), loaded where it fits.

A wheel built with URPE_BUILD_KERNEL=1 carries `packaged/urpe_cpp.so` beside the sources, with
`packaged/kernel.json`: the library's size and SHA-256 (checked before loading, as for a cached
build) and what it was built against. A C++ extension links torch's C++ API, which has no stable
ABI: the library is loaded only under the same torch version, C++ ABI, Python version and
machine type; anywhere else urpe uses a kernel built on this machine (see `build`).

It is compiled without -march=native (the machine that builds the wheel is not the one that
runs it): the row loops are vectorised for the architecture's baseline, and the matrix products
go to torch's BLAS, which picks the CPU's best routine at run time either way.
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


def unsuitable(record: dict[str, Any]) -> str | None:
    """Why a packaged library cannot load here (None: it can)."""
    here = this_torch()
    for fact, value in here.items():
        if record.get(fact) != value:
            return f"was built for {fact} {record.get(fact)} (this is {value})"
    return None


def package_kernel(target: Path, build_flags: list[list[str]], compile_into) -> Path:
    """Compile the kernel for a wheel into `target/packaged/` (the first of `build_flags` that
    builds, each without -march=native); `compile_into(flags, directory, name)` compiles.
    Returns the library."""
    destination = target / DIRECTORY
    destination.mkdir(parents=True, exist_ok=True)
    errors = []
    with tempfile.TemporaryDirectory(prefix="urpe-wheel-kernel-") as scratch:
        for flags in build_flags:
            if any("native" in flag for flag in flags):
                raise ValueError(f"a packaged kernel must run on other machines: {flags}")
            try:
                built = compile_into(flags, Path(scratch), LIBRARY)
            except Exception as error:  # noqa: BLE001 - the next, plainer flag set may build
                errors.append(f"{' '.join(flags)}: {error}")
                continue
            library = destination / built.name
            shutil.copyfile(built, library)
            write_record(destination / RECORD, library, flags=flags, **this_torch())
            return library
    raise RuntimeError("the packaged C++ kernel did not build:\n" + "\n".join(errors))
