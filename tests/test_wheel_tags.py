"""The platform wheel's tag (setup.py's `wheel_platform`): manylinux_2_<N>_<machine> where the
compiled kernel allows it, read from the library's ELF headers (checked against binutils'
readelf), else the build's plain linux_<machine>. The real wheel: tests/test_wheel.py (slow)."""

from __future__ import annotations

import importlib.util
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from urpe.kernels.cpp import build

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(
    sys.platform != "linux" or platform.machine().lower() not in ("x86_64", "aarch64"),
    reason="manylinux tags are for x86-64 and aarch64 Linux",
)


@pytest.fixture(scope="module")
def setup_py():
    """setup.py as a module (its `setup()` runs only as setuptools runs it, as __main__)."""
    spec = importlib.util.spec_from_file_location("urpe_setup", ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def library() -> Path:
    """The C++ kernel this process loaded (built or found by the usual path)."""
    if build.unavailable() is not None:
        pytest.skip(f"the C++ kernel is unavailable: {build.unavailable()}")
    return Path(build.loaded()["library"])


@pytest.mark.skipif(not shutil.which("readelf"), reason="needs binutils' readelf")
def test_the_elf_reader_reads_what_readelf_reads(setup_py, library):
    needed, versions = setup_py.elf_needs(library)
    dynamic = subprocess.run(
        ["readelf", "-dW", str(library)], capture_output=True, text=True, check=True
    ).stdout
    assert needed == set(re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", dynamic))
    symbols = subprocess.run(
        ["readelf", "-VW", str(library)], capture_output=True, text=True, check=True
    ).stdout
    need_section = symbols[symbols.index(".gnu.version_r") :]
    assert versions == set(re.findall(r"Name: (\S+)\s+Flags", need_section))
    assert "libc10.so" in needed and any(v.startswith("GLIBC_2.") for v in versions)


def test_a_wheel_is_tagged_manylinux_only_where_its_library_allows(setup_py, library, monkeypatch):
    """manylinux_2_<N>: N the newer of the library's glibc and torch's wheel's; the plain tag
    where the library needs a library nobody brings, or a libstdc++ newer than torch's."""
    machine = platform.machine().lower()
    real = setup_py.elf_needs
    glibc = max(int(v.split(".")[1]) for v in real(library)[1] if v.startswith("GLIBC_2."))
    torch_level = setup_py.torch_manylinux_level() or 17
    tag, _ = setup_py.wheel_platform(library, "linux_x")
    assert tag == f"manylinux_2_{max(glibc, torch_level)}_{machine}"

    def needing(extra_library=None, extra_version=None):
        def fake(path):
            needed, versions = real(path)
            if path == library:
                needed = needed | ({extra_library} if extra_library else set())
                versions = versions | ({extra_version} if extra_version else set())
            return needed, versions

        return fake

    monkeypatch.setattr(setup_py, "elf_needs", needing("libfoo.so.3"))
    assert setup_py.wheel_platform(library, "linux_x") == (
        "linux_x",
        "it needs libfoo.so.3, which neither torch nor manylinux brings",
    )
    monkeypatch.setattr(setup_py, "elf_needs", needing(extra_version="GLIBCXX_3.4.99"))
    tag, why = setup_py.wheel_platform(library, "linux_x")
    assert tag == "linux_x" and "GLIBCXX_3.4.99, newer than torch's own" in why
    monkeypatch.setattr(setup_py, "elf_needs", needing(extra_version="GLIBC_2.99"))
    assert setup_py.wheel_platform(library, "linux_x")[0] == f"manylinux_2_99_{machine}"
