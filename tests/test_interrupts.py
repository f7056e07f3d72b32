"""Real child processes: SIGKILL mid-run, then --resume, ends exactly where an uninterrupted run
ends; Ctrl-C (SIGINT) stops with one line and leaves a resumable state."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from urpe.cli import main
from urpe.training.checkpoint import load_weights

from .tiny import LEARNS, tiny_flags

FLAGS = tiny_flags("synthetic", **LEARNS, steps=250, checkpoint_every=10)


def _start(out: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "urpe", "reproduce", "synthetic", "--out", str(out), *FLAGS]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )


def _wait_for_checkpoint(child: subprocess.Popen, out: Path, step: int) -> int | None:
    """Poll until a checkpoint at `step` or later exists; return the newest step seen, or None
    when the child ended first (on a loaded machine the tiny run can finish between polls)."""
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        steps = [int(p.name.split("-")[1]) for p in out.glob("runs/*/checkpoints/step-*")]
        if steps and max(steps) >= step:
            return max(steps)
        if child.poll() is not None:
            if child.returncode != 0:
                pytest.fail(f"child failed: {child.communicate()[1][-2000:]}")
            return None
        time.sleep(0.02)
    child.kill()
    pytest.fail("no checkpoint appeared in time")


def _stopped_mid_run(tmp_path: Path, step: int, attempts: int = 3) -> tuple[subprocess.Popen, Path]:
    """A child run frozen (SIGSTOP) after its checkpoint at `step` and before its end.

    Which signal lands where is the behaviour under test, not the machine's scheduling: the
    child is stopped as soon as the checkpoint is seen, and an attempt in which it had already
    written its record (finished) is discarded and started again."""
    for attempt in range(attempts):
        out = tmp_path / f"attempt-{attempt}"
        child = _start(out)
        seen = _wait_for_checkpoint(child, out, step)
        if seen is not None:
            child.send_signal(signal.SIGSTOP)
            if seen < 250 and not list(out.glob("records/*.json")):
                return child, out
            child.send_signal(signal.SIGCONT)
        child.communicate(timeout=120)
    pytest.fail(f"the child finished before it could be stopped, {attempts} times")


def _final(out: Path) -> tuple[dict, dict]:
    (record,) = [json.loads(p.read_text()) for p in (out / "records").glob("*.json")]
    (weights,) = list(out.glob("runs/*/checkpoints/step-00000250/model.safetensors"))
    return record["result"], load_weights(weights)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("whole")
    assert main(["reproduce", "synthetic", "--out", str(out), *FLAGS]) == 0
    return _final(out)


@pytest.mark.slow
def test_sigkill_mid_run_then_resume_matches_an_uninterrupted_run(tmp_path, uninterrupted):
    child, out = _stopped_mid_run(tmp_path, 30)
    child.send_signal(signal.SIGKILL)
    child.communicate()
    assert child.returncode == -signal.SIGKILL
    assert not list(out.glob("records/*.json"))  # killed mid-run, really
    assert main(["reproduce", "synthetic", "--out", str(out), *FLAGS, "--resume"]) == 0
    result, weights = _final(out)
    expected_result, expected_weights = uninterrupted
    assert result == expected_result
    assert weights.keys() == expected_weights.keys()
    assert all(torch.equal(weights[k], expected_weights[k]) for k in weights)


@pytest.mark.slow
def test_ctrl_c_stops_with_one_line_and_resumes(tmp_path, uninterrupted):
    child, out = _stopped_mid_run(tmp_path, 20)
    child.send_signal(signal.SIGINT)  # pending while stopped, delivered on SIGCONT
    child.send_signal(signal.SIGCONT)
    _, err = child.communicate(timeout=120)
    assert child.returncode == 130
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert "interrupted" in last and "--resume" in last
    assert main(["reproduce", "synthetic", "--out", str(out), *FLAGS, "--resume"]) == 0
    assert _final(out)[0] == uninterrupted[0]
