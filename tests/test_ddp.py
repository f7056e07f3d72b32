"""Two processes with DDP on CPU (gloo) end with identical weights, equal to one process
trained on the same global batch; gradient accumulation gives the same result too."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from urpe.training.checkpoint import load_weights

SCRIPT = Path(__file__).with_name("ddp_train.py")


def _run(command, cwd):
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=cwd)
    assert done.returncode == 0, done.stderr[-3000:]


def _close(a, b, tolerance):
    # Key biases are skipped: adding q.b to every logit of a softmax row changes nothing, so
    # their true gradient is 0 and Adam scales float rounding noise up to lr-sized steps.
    names = [k for k in a if not k.endswith("k_proj.bias")]
    return a.keys() == b.keys() and all(
        torch.allclose(a[k], b[k], atol=tolerance, rtol=0) for k in names
    )


@pytest.mark.slow
def test_two_ddp_ranks_match_each_other_and_a_single_process(tmp_path):
    ddp, single, accumulated = tmp_path / "ddp", tmp_path / "single", tmp_path / "accumulated"
    _run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(SCRIPT),
            str(ddp),
            "2",
            "1",
        ],
        cwd=tmp_path,
    )
    _run([sys.executable, str(SCRIPT), str(single), "1", "1"], cwd=tmp_path)
    _run([sys.executable, str(SCRIPT), str(accumulated), "1", "2"], cwd=tmp_path)
    rank0, rank1 = (load_weights(ddp / f"rank{r}.safetensors") for r in (0, 1))
    assert all(torch.equal(rank0[k], rank1[k]) for k in rank0)  # DDP keeps replicas identical
    reference = load_weights(single / "rank0.safetensors")
    assert _close(rank0, reference, 1e-5)
    assert _close(load_weights(accumulated / "rank0.safetensors"), reference, 1e-5)
    assert (ddp / "rank0.metrics").read_text() == (ddp / "rank1.metrics").read_text()
