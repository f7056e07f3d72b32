"""The packaged C++ kernel, opt-in: URPE_BUILD_KERNEL=1 (what `make wheel` sets).

Without it this adds nothing: a pure-Python wheel, or the editable install of `make setup`,
whose kernel is compiled on first use. With it, the wheel's build step compiles the kernel with
portable flags (no -march=native) against the torch of the building environment, which must
therefore be the environment itself: `pip wheel --no-build-isolation` (an isolated build would
fetch another torch). The wheel is then tagged for this Python and platform, and urpe loads
its kernel where the same torch runs (`urpe.kernels.cpp.packaged`). The platform is
manylinux_2_<N>_<machine> where the compiled library allows it (it needs glibc 2.N at most, and
from other libraries only what torch's own need: `wheel_platform` below), else this build's
linux_<machine>; a line at build time says which and why.
"""

import os
import platform
import shutil
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70.1
    from wheel.bdist_wheel import bdist_wheel

OPT_IN = "URPE_BUILD_KERNEL"
WITH_KERNEL = os.environ.get(OPT_IN, "").strip() == "1"
PACKAGED: list[Path] = []  # the library this build compiled


class BuildWithKernel(build_py):
    def run(self):
        super().run()
        kernel = Path(self.build_lib) / "urpe" / "kernels" / "cpp"
        shutil.rmtree(kernel / "packaged", ignore_errors=True)  # none left from an earlier build
        if WITH_KERNEL and not self.editable_mode:
            # The copy in build_lib: its sources are the ones packaged beside the library.
            sys.path.insert(0, self.build_lib)
            try:
                from urpe.kernels.cpp.build import build_for_wheel

                library = build_for_wheel(kernel)
            finally:
                sys.path.remove(self.build_lib)
            PACKAGED.append(library)
            print(f"urpe: packaged the C++ kernel {library}", file=sys.stderr)


class TaggedWheel(bdist_wheel):
    """The platform tag the packaged library allows (`wheel_platform`)."""

    def get_tag(self):
        python, abi, default = super().get_tag()
        if not PACKAGED:
            return python, abi, default
        if not hasattr(self, "_urpe_platform"):  # asked more than once per build
            self._urpe_platform, why = wheel_platform(PACKAGED[-1], default)
            print(
                f"urpe: the wheel's platform tag is {self._urpe_platform} ({why})", file=sys.stderr
            )
        return python, abi, self._urpe_platform


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
    import torch  # the build's own (no build isolation): the one the kernel was compiled for

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


class PlatformWheel(Distribution):
    """A wheel with a compiled library is a platform wheel (cp3XX-cp3XX-<platform>)."""

    def has_ext_modules(self):
        return WITH_KERNEL


if __name__ == "__main__":  # how setuptools runs it; tests import it for `wheel_platform`
    setup(
        cmdclass={"build_py": BuildWithKernel, "bdist_wheel": TaggedWheel},
        distclass=PlatformWheel,
    )
