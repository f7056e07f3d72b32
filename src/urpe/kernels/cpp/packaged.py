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


# ---------------------------------------------------------------------------------------------
# The wheel's platform tag. A manylinux tag promises that the wheel's compiled code runs on any
# Linux with at least that glibc and needs no other system library than the manylinux policy's
# (PEP 600). The kernel also links torch's own libraries (libc10, libtorch_cpu, torch's libgomp),
# which the torch wheel brings and loads first. So the wheel is tagged
# manylinux_2_<N>_<machine>, N the newer of the glibc its library needs and torch's own wheel's
# level, only where the library needs no libraries but those, and no libstdc++ / libgcc / OpenMP
# symbol version newer than torch's own libraries need (then wherever torch runs, they are there).
# Anywhere else the tag stays the plain linux_<machine> of a local build.

# The libraries PEP 600 lets a manylinux wheel take from the system.
SYSTEM_LIBRARIES = frozenset(
    "libgcc_s.so.1 libstdc++.so.6 libm.so.6 libdl.so.2 librt.so.1 libc.so.6 libnsl.so.1 "
    "libutil.so.1 libpthread.so.0 libresolv.so.2 ld-linux-x86-64.so.2 ld-linux-aarch64.so.1 "
    "libX11.so.6 libXext.so.6 libXrender.so.1 libICE.so.6 libSM.so.6 libGL.so.1 "
    "libgobject-2.0.so.0 libgthread-2.0.so.0 libglib-2.0.so.0".split()
)
_SHT_DYNAMIC, _SHT_VERNEED, _DT_NEEDED = 6, 0x6FFFFFFE, 1


def elf_needs(library: Path) -> tuple[set[str], set[str]]:
    """(the libraries a 64-bit little-endian ELF file names as NEEDED, the symbol versions it
    needs from them: "GLIBC_2.17", "GLIBCXX_3.4.21", ...); ValueError for another file."""
    import mmap

    # Mapped, not read: torch's own libraries are hundreds of MB.
    with (
        open(library, "rb") as handle,
        mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data,
    ):
        if data[:4] != b"\x7fELF" or data[4:6] != b"\x02\x01" or len(data) < 64:
            raise ValueError(f"{library} is not a 64-bit little-endian ELF file")
        return _elf_needs(data)


def _elf_needs(data) -> tuple[set[str], set[str]]:
    import struct

    section_offset, entry_size, count = struct.unpack_from("<Q10xHH", data, 0x28)
    sections = [
        struct.unpack_from("<IIQQQQIIQQ", data, section_offset + i * entry_size)
        for i in range(count)
    ]

    def string(section: int, offset: int) -> str:
        start = sections[section][4] + offset
        return data[start : data.find(b"\0", start)].decode()

    needed, versions = set(), set()
    for _, kind, _, _, offset, size, link, info, _, _ in sections:
        if kind == _SHT_DYNAMIC:
            for position in range(offset, offset + size, 16):
                tag, value = struct.unpack_from("<qQ", data, position)
                if tag == _DT_NEEDED:
                    needed.add(string(link, value))
        elif kind == _SHT_VERNEED:
            position = offset
            for _ in range(info):  # Verneed entries, each with its Vernaux chain
                _, aux_count, _, aux, following = struct.unpack_from("<HHIII", data, position)
                entry = position + aux
                for _ in range(aux_count):
                    _, _, _, name, step = struct.unpack_from("<IHHII", data, entry)
                    versions.add(string(link, name))
                    entry += step
                position += following
    return needed, versions


def _version(name: str) -> tuple[str, tuple[int, ...]] | None:
    """("GLIBCXX", (3, 4, 21)) for "GLIBCXX_3.4.21"; None for a name without a number."""
    family, _, number = name.partition("_")
    parts = number.split(".")
    return (family, tuple(map(int, parts))) if all(p.isdigit() for p in parts) else None


def _newest(versions: set[str]) -> dict[str, tuple[int, ...]]:
    newest: dict[str, tuple[int, ...]] = {}
    for parsed in filter(None, map(_version, versions)):
        family, number = parsed
        newest[family] = max(newest.get(family, number), number)
    return newest


def torch_manylinux_level() -> int | None:
    """The glibc minor version of the installed torch wheel's manylinux tag (28 for
    manylinux_2_28; manylinux2014 is 17), or None where torch came otherwise."""
    import importlib.metadata
    import re

    try:
        wheel = importlib.metadata.distribution("torch").read_text("WHEEL") or ""
    except importlib.metadata.PackageNotFoundError:
        return None
    legacy = {"manylinux1": 5, "manylinux2010": 12, "manylinux2014": 17}
    levels = [int(n) for n in re.findall(r"-manylinux_2_(\d+)_", wheel)]
    levels += [n for name, n in legacy.items() if f"-{name}_" in wheel]
    return min(levels) if levels else None


def wheel_platform(library: Path, default: str) -> tuple[str, str]:
    """(the platform tag of a wheel carrying `library`, why): manylinux_2_<N>_<machine> where
    the rule above allows it, else `default` (the build's own linux_<machine>)."""
    machine = platform.machine().lower()
    if sys.platform != "linux" or machine not in ("x86_64", "aarch64"):
        return default, f"not tagged manylinux on {sys.platform} {machine}"
    torch_libraries = Path(torch.__file__).parent / "lib"
    torch_files = sorted(torch_libraries.glob("*.so*"))
    needed, versions = elf_needs(library)
    foreign = sorted(needed - SYSTEM_LIBRARIES - {p.name for p in torch_files})
    if foreign:
        return default, f"it needs {', '.join(foreign)}, which neither torch nor manylinux brings"
    ours, theirs = _newest(versions), _newest(set().union(*(elf_needs(p)[1] for p in torch_files)))
    for family, number in ours.items():
        if family != "GLIBC" and number > theirs.get(family, ()):
            shown = ".".join(map(str, number))
            return default, f"it needs {family}_{shown}, newer than torch's own libraries need"
    level = max(ours.get("GLIBC", (2, 17))[1], torch_manylinux_level() or 17)
    return f"manylinux_2_{level}_{machine}", f"glibc 2.{level} and torch's own libraries"
