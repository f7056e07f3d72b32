"""The platform wheel with the compiled C++ kernel (`make wheel`), installed as a user installs it.

The wheel is built from a copy of the project against the torch running these tests, and
installed into a fresh virtual environment offline: from pip's configured sources on this
machine only (its find-links folders and file:// indexes), torch from the local file. Then,
with no compiler on PATH, "auto" runs the C++ kernel and nothing compiles; with a packaged
kernel built for another torch, urpe says so once and goes on without it.

Slow (a real compile of the kernel, then torch installed into a new environment): minutes.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow, pytest.mark.skipif(sys.platform == "win32", reason="POSIX paths")]

PROBE = """
import warnings, torch, urpe
from urpe.kernels import Toeplitz, attention, reference_attention, select_backend
from urpe.kernels.cpp import build
q = torch.randn(1, 2, 6, 4, dtype=torch.float64)
gate = Toeplitz(torch.rand(2, 11, dtype=torch.float64) + 0.5)
name = select_backend("auto", q, q, q, gate=gate).name
torch.testing.assert_close(attention(q, q, q, gate=gate), reference_attention(q, q, q, gate=gate))
print("FROM", urpe.__file__)
print("AUTO", name)
print("LOADED", build.loaded())
print("ENTRY", build.python_entry() is not None, build._state.get("entry"))
"""


def local_package_sources() -> list[str]:
    """pip options that name only this machine's package files: the find-links folders and
    file:// indexes of pip's own configuration."""
    listed = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True
    ).stdout
    links, indexes = [], []
    for line in listed.splitlines():
        key, _, value = line.partition("=")
        option = key.rsplit(".", 1)[-1]
        for item in value.strip().strip("'\"").split():
            if option == "find-links" and Path(item).is_dir() and item not in links:
                links.append(item)
            elif option.endswith("index-url") and item.startswith("file://"):
                indexes.append(item) if item not in indexes else None
    options = [arg for link in links for arg in ("--find-links", link)]
    if not indexes:
        return ["--no-index", *options]
    extra = [arg for index in indexes[1:] for arg in ("--extra-index-url", index)]
    return ["--index-url", indexes[0], *extra, *options]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh virtual environment with the wheel and the local torch installed; its python."""
    work = tmp_path_factory.mktemp("wheel")
    project = work / "project"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    shutil.copytree(ROOT / "src", project / "src", ignore=ignore)
    for name in ("pyproject.toml", "setup.py", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, project / name)
    env = dict(os.environ, URPE_BUILD_KERNEL="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-build-isolation",
            "--no-deps",
            "--no-index",
            "-w",
            str(work / "dist"),
            str(project),
        ],
        env=env,
        check=True,
        capture_output=True,
        timeout=1500,
    )
    (wheel,) = (work / "dist").glob("urpe-*.whl")
    py = f"cp{sys.version_info.major}{sys.version_info.minor}"
    assert wheel.name.endswith(".whl") and f"-{py}-{py}-" in wheel.name  # a platform wheel
    names = zipfile.ZipFile(wheel).namelist()
    assert "urpe/kernels/cpp/packaged/kernel.json" in names
    if sys.platform == "linux" and platform.machine() in ("x86_64", "aarch64"):
        # tagged for the glibc its kernel needs, not the plain linux_<machine> of a local build
        spec = importlib.util.spec_from_file_location("urpe_setup", ROOT / "setup.py")
        setup_py = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(setup_py)
        wheel_platform = setup_py.wheel_platform
        record = json.loads(zipfile.ZipFile(wheel).read("urpe/kernels/cpp/packaged/kernel.json"))
        with zipfile.ZipFile(wheel) as archive, tempfile.TemporaryDirectory() as scratch:
            library = Path(
                archive.extract(f"urpe/kernels/cpp/packaged/{record['library']}", scratch)
            )
            expected, _ = wheel_platform(library, f"linux_{platform.machine()}")
        assert expected.startswith("manylinux_2_") and wheel.name.endswith(f"-{expected}.whl")

    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    offline = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
    offline.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1")
    done = subprocess.run(
        [
            str(python),
            "-m",
            "pip",
            "install",
            *local_package_sources(),
            str(wheel),
            f"torch=={torch.__version__}",
        ],
        env=offline,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    if done.returncode != 0 and "No matching distribution found for torch" in done.stdout + (
        done.stderr
    ):
        pytest.skip(f"no local torch {torch.__version__} wheel among pip's local sources")
    assert done.returncode == 0, done.stderr[-3000:]
    return python


def _probe(python: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    """PROBE in the new environment: its own bin folder alone on PATH (python, pip, ninja; no
    compiler), a fresh cache, none of this checkout on the path."""
    bin_folder = python.parent
    assert not any(shutil.which(cc, path=str(bin_folder)) for cc in ("c++", "g++", "cc", "clang"))
    env = {"HOME": str(tmp_path), "PATH": str(bin_folder), "URPE_CACHE_DIR": str(tmp_path)}
    done = subprocess.run(
        [str(python), "-c", PROBE],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"FROM {python.parents[1]}" in done.stdout  # the installed urpe, not this checkout
    return done


def test_the_wheel_runs_its_packaged_kernel_without_a_compiler(installed, tmp_path):
    done = _probe(installed, tmp_path)
    assert "AUTO cpp" in done.stdout and "'source': 'packaged'" in done.stdout
    assert "ENTRY True" in done.stdout  # its Python entry imports too (a fixed module name)
    assert "urpe:" not in done.stderr  # nothing compiled, nothing to say
    assert not (tmp_path / "cpp-kernel").exists()


def test_a_packaged_kernel_for_another_torch_is_said_once_and_left_alone(installed, tmp_path):
    site = next(installed.parents[1].glob("lib/python*/site-packages"))
    record_path = site / "urpe" / "kernels" / "cpp" / "packaged" / "kernel.json"
    original = record_path.read_text()
    record_path.write_text(json.dumps({**json.loads(original), "torch": "0.0.0"}))
    try:
        done = _probe(installed, tmp_path)
    finally:
        record_path.write_text(original)
    assert "AUTO blockwise" in done.stdout
    said = [line for line in done.stderr.splitlines() if "urpe" in line]
    refused = "the kernel packaged with urpe does not fit here: built for torch 0.0.0; this"
    assert sum(refused in line for line in said) == 1, said
    unavailable = [line for line in said if "kernel is unavailable (no C++ compiler" in line]
    assert len(unavailable) == 1 and refused in unavailable[0], said
