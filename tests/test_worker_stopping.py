"""Stopping a parallel sweep by its PID: SIGKILL or SIGTERM of the main process ends its --jobs
workers too (they used to go on training as orphans, racing a following --resume), and
--resume afterwards ends exactly where an uninterrupted sweep ends."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from urpe.cli import main

from .tiny import LEARNS, tiny_flags

FLAGS = tiny_flags(
    "synthetic", **LEARNS, variants="urpe,rpe", steps=300, checkpoint_every=10, jobs=None
)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == pid and b"spawn_main" in cmdline:
                found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _start_and_wait(out: Path) -> tuple[subprocess.Popen, list[int]]:
    """The sweep with two workers, once both have written a checkpoint and none has finished."""
    command = [
        sys.executable,
        "-m",
        "urpe",
        "reproduce",
        "synthetic",
        "--out",
        str(out),
        *FLAGS,
        "--jobs",
        "2",
    ]
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        runs = {p.parent.parent.name for p in out.glob("runs/*/checkpoints/step-*")}
        if len(runs) == 2:
            workers = _children(child.pid)
            if len(workers) == 2 and not list(out.glob("records/*.json")):
                return child, workers
        if child.poll() is not None:
            pytest.fail(f"the sweep ended first: {child.communicate()[1][-2000:]}")
        time.sleep(0.05)
    child.kill()
    pytest.fail("no checkpoints in time")


def _gone(pids: list[int], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any(_alive(p) for p in pids):
            return True
        time.sleep(0.1)
    for pid in pids:  # do not leave them behind
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
    return False


def _results(out: Path) -> dict:
    return {
        json.loads(p.read_text())["name"]: json.loads(p.read_text())["result"]
        for p in (out / "records").glob("*.json")
    }


@pytest.mark.slow
def test_sigkill_of_the_main_process_stops_its_workers_and_resume_is_exact(tmp_path):
    child, workers = _start_and_wait(tmp_path / "killed")
    child.kill()
    child.communicate()
    # A run has hundreds of updates left: a worker still alive seconds later is an orphan.
    assert _gone(workers, seconds=3), "workers went on after their sweep was killed"
    assert not list((tmp_path / "killed").glob("records/*.json"))
    argv = ["reproduce", "synthetic", *FLAGS, "--jobs", "1"]
    assert main([*argv, "--out", str(tmp_path / "killed"), "--resume"]) == 0
    assert main([*argv, "--out", str(tmp_path / "whole")]) == 0
    assert _results(tmp_path / "killed") == _results(tmp_path / "whole")


@pytest.mark.slow
def test_sigterm_stops_the_workers_with_one_line(tmp_path):
    child, workers = _start_and_wait(tmp_path / "out")
    child.send_signal(signal.SIGTERM)
    _, err = child.communicate(timeout=60)
    assert child.returncode == 143
    assert "Traceback" not in err and "--resume" in err.strip().splitlines()[-1]
    assert _gone(workers, seconds=5)
