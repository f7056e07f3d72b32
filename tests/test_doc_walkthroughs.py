"""The "Your own data" guide's walkthroughs run as written: its shell blocks, each in a fresh
folder (`urpe` and `python` are this interpreter)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "guides" / "own-data.md"
BLOCKS = re.findall(r"```bash\n(.*?)```", GUIDE.read_text(), flags=re.S)


def test_the_quick_start_has_a_molecule_and_a_text_block():
    assert len(BLOCKS) == 2
    assert "urpe predict" in BLOCKS[0] and "urpe evaluate" in BLOCKS[0]
    assert "urpe evaluate" in BLOCKS[1] and "urpe generate" in BLOCKS[1]


def _one_core() -> None:
    """The commands see one core, as a test should use: a sweep then trains with one thread
    (two threads on a busy two-core machine run its updates about 20 times slower)."""
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})


# Slow (about 70 s together, mostly process start-up): the same workflows run in the default
# suite through test_molecule_files.py and test_lm_files.py; this checks the guide's text itself.
@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_quick_start_block_runs(index, tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, command in (
        ("urpe", f'exec "{sys.executable}" -m urpe "$@"'),
        ("python", f'exec "{sys.executable}" "$@"'),
    ):
        (bin_dir / name).write_text(f"#!/bin/sh\n{command}\n")
        (bin_dir / name).chmod(0o755)
    src = str(Path(__file__).resolve().parents[1] / "src")
    path = os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "OMP_NUM_THREADS": "1",
        "URPE_CACHE_DIR": str(tmp_path / "cache"),
        "PYTHONPATH": path,
    }
    work = tmp_path / "work"
    work.mkdir()
    done = subprocess.run(
        ["bash", "-e", "-c", BLOCKS[index]],
        cwd=work,
        env=env,
        text=True,
        capture_output=True,
        timeout=600,
        preexec_fn=_one_core,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    if index == 0:
        lines = (work / "predictions.csv").read_text().splitlines()
        assert lines[0] == "smiles,predicted_logp" and len(lines) == 3
        assert done.stdout.strip().splitlines()[-1].startswith("MAE ")
    else:
        assert '"bpc"' in done.stdout and done.stdout.rstrip().splitlines()[-1]
