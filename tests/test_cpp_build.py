"""The C++ kernel's cache under what happens to real caches: a build killed mid-way (its lock
left behind), a build that hangs, another process building, a truncated library, no compiler
beside a good cached build. Each case runs in a subprocess with a fresh cache and a timeout, so
that a hang fails the test instead of blocking the run. A "compiler" here is a small script
that fails or hangs at once: no case compiles for real, except the slow one."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from urpe.kernels.cpp import build, toolchain
from urpe.kernels.cpp.packaged import this_torch, wheel_builds
from urpe.kernels.cpp.toolchain import TORCH_LOCK, build_lock
from urpe.kernels.cpp.verified import mismatch, read_record, write_record

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="shell-script compilers")

# Prints which kernel "auto" runs for a URPE call, checked against the reference. ONE_BUILD:
# only the first build is tried (a failing compiler fails each build alike; each try starts a
# process).
PROBE = """
import os, warnings, torch
from urpe.kernels import Toeplitz, attention, reference_attention, select_backend
from urpe.kernels.cpp import build
if os.environ.get("ONE_BUILD"):
    build.BUILDS = build.BUILDS[:1]
q = torch.randn(1, 2, 6, 4, dtype=torch.float64)
gate = Toeplitz(torch.rand(2, 11, dtype=torch.float64) + 0.5)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    name = select_backend("auto", q, q, q, gate=gate).name
    out = attention(q, q, q, gate=gate)
torch.testing.assert_close(out, reference_attention(q, q, q, gate=gate))
print("AUTO", name)
print("REASON", build.unavailable())
print("WARNINGS", sum("C++" in str(w.message) for w in caught))
"""


def probe(tmp_path: Path, timeout: float = 60, **env: str) -> tuple[str, str]:
    """Run PROBE with the cache in tmp_path/cache; (stdout, stderr). Fails if it hangs."""
    full = dict(os.environ, URPE_CACHE_DIR=str(tmp_path / "cache"), URPE_KERNEL_CACHE_DIR="", **env)
    try:
        done = subprocess.run(
            [sys.executable, "-c", PROBE], env=full, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"the first attention call still hung after {timeout} s")
    assert done.returncode == 0, f"exit status {done.returncode}: {done.stderr[-3000:]}"
    return done.stdout, done.stderr


def fake_compiler(tmp_path: Path, body: str) -> str:
    """A `c++` that runs `body` (sh): CXX for a subprocess."""
    script = tmp_path / "bin" / "c++"
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(0o755)
    return str(script)


def cache_directories(tmp_path: Path, compiler: str | None) -> list[Path]:
    """The cache folders of every build the subprocess would try, for a CXX of `compiler`."""
    saved = os.environ.get("CXX")
    os.environ.pop("CXX", None)
    if compiler is not None:
        os.environ["CXX"] = compiler
    try:
        keys = [build.build_key(build.compile_flags(**b)) for b in build.BUILDS]
    finally:
        os.environ.pop("CXX", None)
        if saved is not None:
            os.environ["CXX"] = saved
    return [tmp_path / "cache" / "cpp-kernel" / key for key in keys]


@pytest.fixture(scope="module")
def built_library() -> Path:
    """The library this process loaded (built or found by the usual path)."""
    if build.unavailable() is not None:
        pytest.skip(f"the C++ kernel is unavailable: {build.unavailable()}")
    return Path(build.loaded()["library"])


def install_cached(built: Path, directory: Path) -> Path:
    """A copy of a good build in `directory`, recorded as its build records it."""
    directory.mkdir(parents=True)
    library = directory / f"{build.NAMESPACE}_{directory.name}.so"
    shutil.copyfile(built, library)
    write_record(directory / build.RECORD, library)
    return library


@pytest.mark.slow
def test_a_build_killed_mid_way_leaves_no_lock_that_hangs_the_next_process(tmp_path):
    """torch's lock file from a killed build: the next process builds (here the compiler fails
    at once) instead of waiting for a lock that nobody will release."""
    compiler = fake_compiler(tmp_path, 'echo "fake compiler: no" >&2; exit 1')
    directory = cache_directories(tmp_path, compiler)[0]
    directory.mkdir(parents=True)
    (directory / TORCH_LOCK).write_text("")
    (directory / "library.o").write_text("half a file")
    out, err = probe(tmp_path, CXX=compiler, ONE_BUILD="1")
    assert "AUTO blockwise" in out and "WARNINGS 1" in out
    assert "REASON the build failed: the compiler failed" in out
    assert err.count("urpe: compiling the C++ CPU attention kernel") == 1
    assert not directory.exists()  # nothing half-built left for the next build


@pytest.mark.slow  # waits out the build's time limit by design (12 s on 2 cores)
def test_a_build_that_hangs_is_stopped_after_the_time_allowed(tmp_path):
    pids = tmp_path / "compiler-pids"
    compiler = fake_compiler(tmp_path, f"echo $$ >> {pids}; exec sleep 120")
    start = time.monotonic()
    out, _ = probe(tmp_path, CXX=compiler, ONE_BUILD="1", **{build.TIMEOUT: "8"})
    assert time.monotonic() - start < 40
    assert "AUTO blockwise" in out and "WARNINGS 1" in out
    assert "REASON the build took over 8 s and was stopped" in out
    for pid in map(int, pids.read_text().split()):  # the compiler was stopped with the build
        assert stopped(pid), f"the compiler (pid {pid}) still runs"


def stopped(pid: int, wait: float = 10.0) -> bool:
    """Gone, or a zombie: a killed grandchild is re-parented to init, which may reap it late."""
    deadline = time.monotonic() + wait
    while True:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state in "ZX":
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


# Loads toolchain.py alone (it imports nothing of urpe's): a holder that starts in milliseconds.
HOLDER = """
import importlib.util, sys, time
from pathlib import Path
spec = importlib.util.spec_from_file_location("toolchain", sys.argv[2])
toolchain = importlib.util.module_from_spec(spec)
spec.loader.exec_module(toolchain)
with toolchain.build_lock(Path(sys.argv[1]), 5, print):
    print("HELD", flush=True)
    time.sleep(120)
"""


def _hold(lock: Path) -> subprocess.Popen:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(lock), toolchain.__file__],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline().strip() == "HELD"
    return holder


@pytest.mark.slow  # waits out the bounded wait by design
def test_another_process_building_is_waited_for_a_bounded_time(tmp_path):
    compiler = fake_compiler(tmp_path, "exit 1")
    first = cache_directories(tmp_path, compiler)[0]
    holder = _hold(first.parent / f"{first.name}.lock")
    try:
        out, err = probe(tmp_path, CXX=compiler, ONE_BUILD="1", **{build.TIMEOUT: "2"})
    finally:
        holder.kill()
        holder.wait()
    assert "AUTO blockwise" in out and "WARNINGS 1" in out
    assert f"has held the build lock {first}.lock for over 2 s (pid {holder.pid} on" in out
    assert err.count("urpe: waiting for another process to finish compiling") == 1


def test_the_lock_of_a_killed_builder_is_free_at_once(tmp_path):
    holder = _hold(tmp_path / "key.lock")
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    with build_lock(tmp_path / "key.lock", 0, pytest.fail):  # 0: no wait allowed
        assert f'"pid": {os.getpid()}' in (tmp_path / "key.lock").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("compiler", ["fails", "none"])
def test_a_truncated_cached_library_is_never_loaded(tmp_path, built_library, compiler):
    """Loading half a library kills the process with SIGBUS; it is rebuilt instead (here the
    compiler fails) or, with no compiler, "auto" runs blockwise and says why."""
    env = {"ONE_BUILD": "1"}
    if compiler == "fails":
        env["CXX"] = fake_compiler(tmp_path, "exit 1")
    else:
        (tmp_path / "empty").mkdir()
        env["PATH"] = str(tmp_path / "empty")  # no compiler, no ninja
    directory = cache_directories(tmp_path, env.get("CXX"))[0]
    library = install_cached(built_library, directory)
    os.truncate(library, library.stat().st_size // 2)
    out, _ = probe(tmp_path, **env)
    assert "AUTO blockwise" in out and "WARNINGS 1" in out
    if compiler == "none":
        assert "the cached build is unusable" in out and "(damaged)" in out
    else:
        assert "REASON the build failed" in out


def test_a_good_cached_build_loads_without_a_compiler(tmp_path, built_library):
    (tmp_path / "empty").mkdir()
    install_cached(built_library, cache_directories(tmp_path, None)[0])
    out, err = probe(tmp_path, PATH=str(tmp_path / "empty"))
    assert "AUTO cpp" in out and "REASON None" in out and "WARNINGS 0" in out
    assert err == ""


def test_a_record_tells_a_damaged_library_from_the_built_one(tmp_path):
    library = tmp_path / "lib.so"
    library.write_bytes(b"\x7fELF" + bytes(1000))
    record = write_record(tmp_path / "ready", library, flags=["-O3"])
    assert read_record(tmp_path / "ready") == record and mismatch(record, library) is None
    library.write_bytes(b"\x7fELF" + bytes(999) + b"\x01")  # same size, other bytes
    assert "differs from the library its build wrote" in mismatch(record, library)
    os.truncate(library, 500)
    assert "has 500 bytes, its build wrote 1004" in mismatch(record, library)
    (tmp_path / "ready").write_text("urpe_cpp_0123\n")  # an older urpe's record: built again
    assert read_record(tmp_path / "ready") is None


# A packaged kernel (what a wheel built with URPE_BUILD_KERNEL=1 holds), in place of the
# install's own folder: tests/test_wheel.py builds and installs a real wheel (slow).
PACKAGED = """
import json, sys
from pathlib import Path
from urpe.kernels.cpp import build
build.packaged_kernel = lambda: (Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text()))
"""


@pytest.mark.parametrize("case", ["fits", "damaged", "other torch", "other cpu", "cached"])
def test_a_packaged_kernel_comes_first_where_it_fits(tmp_path, built_library, case):
    """Where the packaged kernel does not fit, why is said once, in the reason no kernel runs
    (here: no compiler); where a cached build loads instead, nothing is said at all."""
    library = tmp_path / "packaged" / "urpe_cpp.so"
    library.parent.mkdir()
    shutil.copyfile(built_library, library)
    facts = {**this_torch(), "cpu_features": ["sse2"]}
    if case in ("other torch", "cached"):
        facts["torch"] = "0.0.0"
    if case == "cached":  # a build from an earlier process of this machine
        install_cached(built_library, cache_directories(tmp_path, None)[0])
    if case == "other cpu":
        facts["cpu_features"] = ["avx2", "a-set-no-cpu-has"]
    write_record(tmp_path / "kernel.json", library, **facts)
    if case == "damaged":
        os.truncate(library, library.stat().st_size // 2)
    (tmp_path / "empty").mkdir()
    code = PACKAGED + "print('LOADED', build.loaded())\n"
    done = subprocess.run(
        [sys.executable, "-c", code, str(library), str(tmp_path / "kernel.json")],
        env=dict(
            os.environ,
            PATH=str(tmp_path / "empty"),
            URPE_CACHE_DIR=str(tmp_path / "cache"),
            URPE_KERNEL_CACHE_DIR="",
        ),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    said = [line for line in done.stderr.splitlines() if "packaged with urpe" in line]
    if case in ("fits", "cached"):
        source = "packaged" if case == "fits" else "cache"
        assert f"'source': '{source}'" in done.stdout and done.stderr == ""
        return
    assert "LOADED None" in done.stdout and len(said) == 1, done.stderr
    assert "C++ CPU attention kernel is unavailable (" in said[0]  # no compiler, no ninja
    assert "; the kernel packaged with urpe does not fit here: " in said[0]
    assert {
        "damaged": "(damaged)",
        "other torch": "built for torch 0.0.0; this is",
        "other cpu": "built for CPUs with a-set-no-cpu-has, which this one lacks",
    }[case] in said[0]


def test_a_wheel_is_compiled_for_other_machines():
    portable = [build.compile_flags(**b) for b in build.BUILDS if not b["native"]]
    builds = wheel_builds(portable)
    assert builds and not any("native" in f for flags, _ in builds for f in flags)
    if build.platform.machine().lower() in ("x86_64", "amd64"):
        assert builds[0][0][-1] == "-march=x86-64-v3" and "avx2" in builds[0][1]
        assert builds[-1] == (portable[-1], ())  # a compiler without x86-64-v3 still builds one


@pytest.mark.slow
def test_a_killed_build_is_redone_for_real(tmp_path):
    """The real compiler after a build killed mid-way: the kernel is built and "auto" runs it."""
    for directory in cache_directories(tmp_path, os.environ.get("CXX")):
        directory.mkdir(parents=True)
        (directory / TORCH_LOCK).write_text("")
    out, err = probe(tmp_path, timeout=900)
    assert "AUTO cpp" in out and "REASON None" in out
    assert err.count("urpe: compiling the C++ CPU attention kernel") == 1


def attends(config: dict, context) -> object:
    """A sweep's run: one URPE attention call on the CPU (the first loads the C++ kernel)."""
    import torch

    from urpe.experiments.records import RunResult
    from urpe.kernels import Toeplitz, attention

    q = torch.randn(1, 2, 6, 4)
    attention(q, q, q, gate=Toeplitz(torch.ones(2, 11)))
    return RunResult({"x": config["x"]})


SWEEP = """
import sys
from urpe.experiments.runner import Execution, RunSpec, sweep
from urpe.kernels.cpp import build
from tests.test_cpp_build import attends
build.BUILDS = build.BUILDS[:1]  # one failing build is enough (each starts a process)
specs = [RunSpec(f"x{x}", {"x": x}) for x in range(3)]
execution = Execution(jobs=int(sys.argv[2]), threads=1, progress=True)
print("TRAINED", sweep(attends, specs, sys.argv[1], execution, resume=False).trained)
"""


# one process and two (the parallel sweep that builds before its workers); each builds the kernel
@pytest.mark.slow
@pytest.mark.parametrize("jobs", [1, 2])
def test_a_sweep_says_once_on_its_own_line_that_it_compiles_the_kernel(tmp_path, jobs):
    """Not once per worker (each used to compile or wait on its own, and say so in its own
    stderr): a parallel sweep builds it before it starts its workers, and says why it cannot.
    The line goes above the progress bar, not after it."""
    env = dict(
        os.environ,
        URPE_CACHE_DIR=str(tmp_path / "cache"),
        URPE_KERNEL_CACHE_DIR="",
        CXX=fake_compiler(tmp_path, "exit 1"),
    )
    done = subprocess.run(
        [sys.executable, "-c", SWEEP, str(tmp_path / "out"), str(jobs)],
        env=env,
        cwd=Path(__file__).parents[1],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert "TRAINED 3" in done.stdout, done.stderr[-3000:]
    lines = done.stderr.replace("\r", "\n").splitlines()
    compiling = [line for line in lines if "urpe: compiling the C++ CPU" in line]
    assert len(compiling) == 1 and compiling[0].startswith("urpe: compiling"), done.stderr
    assert done.stderr.count("the C++ CPU attention kernel is unavailable") == 1, done.stderr


def test_a_named_target_cpu_replaces_native_and_keys_its_own_build(monkeypatch):
    """$URPE_CPP_TARGET (e.g. haswell, for valgrind, which runs no AVX-512): -march=<it>
    instead of -march=native, and a build key of its own."""
    monkeypatch.setenv(build.TARGET, "haswell")
    flags = build.compile_flags()
    assert "-march=native" not in flags and "-mcpu=native" not in flags
    assert "-march=haswell" in flags or "-mcpu=haswell" in flags
    monkeypatch.delenv(build.TARGET)
    assert build.build_key(flags) != build.build_key(build.compile_flags())
