"""The raw C++ ops `torch.ops.urpe_cpp.forward` / `.backward` check their arguments.

The ops are public, so a wrong argument must raise a RuntimeError that names it, never read or
write out of bounds: mismatched q, k, v sizes once gave garbage and an out-of-range relation
index crashed the process. A crash cannot be caught in-process, so every bad call runs in one
child process (`python -m tests.test_cpp_raw_ops`), which prints one line per call as it goes;
each test reads its call's line, and a call that killed the child is reported as such.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from urpe.kernels.cpp import unavailable

B, H, HKV, LQ, LK, D, DV, R = 2, 4, 2, 5, 7, 8, 3, 6
LANES = 16  # padding after each Toeplitz row (kLanes in tile.h)
F64 = dict(dtype=torch.float64)
NORMS = {"softmax": 0, "exp": 1, "l2": 2, "relu2": 3}
KINDS = {"none": 0, "dense": 1, "toeplitz": 2, "relation": 3, "decay": 4}


def good_forward() -> dict:
    """A valid forward call: relation bias, Toeplitz gate, both masks, relu2, GQA."""
    gen = torch.Generator().manual_seed(0)
    return dict(
        q=torch.randn(B, H, LQ, D, generator=gen, **F64),
        k=torch.randn(B, HKV, LK, D, generator=gen, **F64),
        v=torch.randn(B, HKV, LK, DV, generator=gen, **F64),
        bias_kind=KINDS["relation"],
        bias=torch.randn(H, R, generator=gen, **F64),
        bias_index=torch.randint(0, R, (1, LQ, LK), generator=gen),
        gate_kind=KINDS["toeplitz"],
        gate=torch.rand(1, LQ + LK - 1 + LANES, generator=gen, **F64),
        gate_index=None,
        float_mask=torch.randn(1, H, 1, LK, generator=gen, **F64),
        bool_mask=torch.rand(LQ, LK, generator=gen)[None, None] < 0.8,
        key_padding=torch.rand(B, LK, generator=gen) < 0.2,
        documents=torch.randint(0, 3, (B, LK), generator=gen),
        fixed=torch.full((B, H, LQ), float(LK), **F64),
        causal=True,
        norm=NORMS["relu2"],
        scale=0.3,
        dropout_p=0.0,
        dropout_threshold=0,
        dropout_seed=None,
        block_q=2,
        block_k=4,
    )


def good_backward() -> dict:
    call = good_forward()
    return dict(
        grad_out=torch.randn(B, H, LQ, DV, **F64),
        stat=torch.full((B, H, LQ), float(LK), **F64),
        out=torch.randn(B, H, LQ, DV, **F64),
        **call,
        needs_bias=True,
        needs_gate=True,
        needs_mask=True,
        items_per_thread=4,
    )


def _index(value: int) -> torch.Tensor:
    index = torch.zeros(1, LQ, LK, dtype=torch.int64)
    index[0, LQ - 1, LK - 1] = value
    return index


# name -> (op, changes to the good call); each must raise a RuntimeError naming the problem
BAD_CALLS = {
    "k batch": ("forward", dict(k=torch.zeros(B + 1, HKV, LK, D, **F64))),
    "v batch": ("forward", dict(v=torch.zeros(1, HKV, LK, DV, **F64))),
    "v length": ("forward", dict(v=torch.zeros(B, HKV, LK + 5, DV, **F64))),
    "v heads": ("forward", dict(v=torch.zeros(B, 1, LK, DV, **F64))),
    "k head dim": ("forward", dict(k=torch.zeros(B, HKV, LK, D + 1, **F64))),
    "heads not a multiple": (
        "forward",
        dict(k=torch.zeros(B, 3, LK, D, **F64), v=torch.zeros(B, 3, LK, DV, **F64)),
    ),
    "q rank": ("forward", dict(q=torch.zeros(H, LQ, D, **F64))),
    "q strided": ("forward", dict(q=torch.zeros(B, H, D, LQ, **F64).transpose(2, 3))),
    "q dtype": ("forward", dict(q=torch.zeros(B, H, LQ, D))),
    "q integer": ("forward", dict(q=torch.zeros(B, H, LQ, D, dtype=torch.int64))),
    "relation index too large": ("forward", dict(bias_index=_index(R))),
    "relation index far too large": ("forward", dict(bias_index=_index(10**9))),
    "relation index negative": ("forward", dict(bias_index=_index(-1))),
    "relation index shape": (
        "forward",
        dict(bias_index=torch.zeros(1, LQ, LK + 1, dtype=torch.int64)),
    ),
    "relation index dtype": ("forward", dict(bias_index=torch.zeros(1, LQ, LK, dtype=torch.int32))),
    "relation without index": ("forward", dict(bias_index=None)),
    "table heads": ("forward", dict(bias=torch.zeros(3, R, **F64))),
    "table dtype": ("forward", dict(bias=torch.zeros(H, R))),
    "toeplitz width": ("forward", dict(gate=torch.zeros(1, LQ + LK, **F64))),
    "toeplitz heads": ("forward", dict(gate=torch.zeros(H + 1, LQ + LK - 1 + LANES, **F64))),
    "kind without tensor": ("forward", dict(gate=None)),
    "unknown kind": ("forward", dict(gate_kind=7)),
    "dense term shape": (
        "forward",
        dict(gate_kind=KINDS["dense"], gate=torch.zeros(B, H, LQ, LK + 1, **F64)),
    ),
    "dense term rank": (
        "forward",
        dict(gate_kind=KINDS["dense"], gate=torch.zeros(H, LQ, LK, **F64)),
    ),
    "float mask shape": ("forward", dict(float_mask=torch.zeros(1, 1, LQ + 2, LK, **F64))),
    "bool mask shape": ("forward", dict(bool_mask=torch.ones(1, H + 1, LQ, LK, dtype=torch.bool))),
    "bool mask dtype": ("forward", dict(bool_mask=torch.ones(1, 1, LQ, LK, dtype=torch.uint8))),
    "key padding length": ("forward", dict(key_padding=torch.zeros(B, LK + 3, dtype=torch.bool))),
    "key padding batch": ("forward", dict(key_padding=torch.zeros(B + 1, LK, dtype=torch.bool))),
    "key padding dtype": ("forward", dict(key_padding=torch.zeros(B, LK, **F64))),
    "documents length": ("forward", dict(documents=torch.zeros(B, LK + 1, dtype=torch.int64))),
    "documents dtype": ("forward", dict(documents=torch.zeros(B, LK, dtype=torch.int32))),
    "documents strided": ("forward", dict(documents=torch.zeros(LK, B, dtype=torch.int64).t())),
    "decay shape": (
        "forward",
        dict(bias_kind=KINDS["decay"], bias=torch.zeros(B, H, LK + 1, **F64)),
    ),
    "decay rank": ("forward", dict(bias_kind=KINDS["decay"], bias=torch.zeros(H, LK, **F64))),
    "statistic missing": ("forward", dict(fixed=None)),
    "statistic size": ("forward", dict(fixed=torch.ones(B, H, LQ - 1, **F64))),
    "statistic dtype": ("forward", dict(fixed=torch.ones(B, H, LQ))),
    "unknown normalisation": ("forward", dict(norm=9)),
    "dropout of 1": ("forward", dict(dropout_p=1.0)),
    "dropout without a seed": ("forward", dict(dropout_p=0.5, dropout_threshold=2**31)),
    "dropout seed not integer": (
        "forward",
        dict(dropout_p=0.5, dropout_threshold=2**31, dropout_seed=torch.tensor(1.5)),
    ),
    "tile size 0": ("forward", dict(block_q=0)),
    "backward relation index too large": ("backward", dict(bias_index=_index(R + 100))),
    "backward grad_out shape": ("backward", dict(grad_out=torch.zeros(B, H, LQ, DV + 1, **F64))),
    "backward grad_out dtype": ("backward", dict(grad_out=torch.zeros(B, H, LQ, DV))),
    "backward grad_out strided rows": (
        "backward",
        dict(grad_out=torch.zeros(B, H, DV, LQ, **F64).transpose(2, 3)),
    ),
    "q strided rows": ("forward", dict(q=torch.zeros(B, H, D, LQ, **F64).transpose(2, 3))),
    "k overlapping rows": (
        "forward",
        dict(k=torch.zeros(B, HKV, 1, D, **F64).expand(B, HKV, LK, D)),
    ),
    "backward stat size": ("backward", dict(stat=torch.zeros(B, H, **F64))),
    "backward out dtype": ("backward", dict(out=torch.zeros(B, H, LQ, DV))),
    "backward out shape": ("backward", dict(out=torch.zeros(B, H, LQ, **F64))),
}


def run_calls(names) -> None:
    """The child: each call in turn, one JSON line each ({"name", "outcome", "message"})."""
    assert unavailable() is None, unavailable()
    goods = {"forward": good_forward, "backward": good_backward}
    for name in names:
        op, changes = ("forward", {}) if name.startswith("good") else BAD_CALLS[name]
        if name == "good backward":
            op = "backward"
        call = dict(goods[op](), **changes)
        try:
            getattr(torch.ops.urpe_cpp, op)(**call)
            outcome, message = "ok", ""
        except Exception as error:  # noqa: BLE001 - what it raised is the finding
            outcome, message = type(error).__name__, str(error).splitlines()[0]
        print(json.dumps(dict(name=name, outcome=outcome, message=message)), flush=True)


ALL_CALLS = ["good forward", "good backward", *BAD_CALLS]


@pytest.fixture(scope="module")
def outcomes() -> dict:
    """name -> (outcome, message) of every call, run in child processes: one that dies is
    recorded as a crash of its call, and a new child goes on from the next call."""
    if unavailable() is not None:
        pytest.skip(unavailable())
    root = Path(__file__).resolve().parents[1]
    found: dict = {}
    while len(found) < len(ALL_CALLS):
        result = subprocess.run(
            [sys.executable, "-m", "tests.test_cpp_raw_ops", str(len(found))],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=600,
            env=dict(os.environ),
        )
        for line in result.stdout.splitlines():
            record = json.loads(line)
            found[record["name"]] = (record["outcome"], record["message"])
        if result.returncode != 0 and len(found) < len(ALL_CALLS):  # this call killed it
            found[ALL_CALLS[len(found)]] = ("crash", f"exit status {result.returncode}")
    return found


@pytest.mark.parametrize("name", ["good forward", "good backward"])
def test_the_valid_call_runs(outcomes, name):
    assert outcomes.get(name) == ("ok", ""), outcomes.get(name)


@pytest.mark.parametrize("name", list(BAD_CALLS))
def test_a_bad_raw_call_raises_a_clear_error(outcomes, name):
    outcome, message = outcomes[name]
    assert outcome == "RuntimeError" and "urpe_cpp" in message, (outcome, message)


if __name__ == "__main__":
    run_calls(ALL_CALLS[int(sys.argv[1]) :])
