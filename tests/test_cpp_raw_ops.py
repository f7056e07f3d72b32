"""The raw C++ ops `torch.ops.urpe_cpp.forward` / `.forward_if_finite` / `.backward` check their
arguments.

The ops are public, so a wrong argument must raise a RuntimeError that names it, never read or
write out of bounds: mismatched q, k, v sizes once gave garbage, an out-of-range relation
index crashed the process, a backward with batch 0 died of SIGFPE and one-entry document ids
were read at every key. A crash cannot be caught in-process, so every call runs in one child
process (`python -m tests.test_cpp_raw_ops`), which prints one line per call as it goes; each
test reads its call's line, and a call that killed the child is reported as such. Valid calls
at the edges (empty dims, tiles larger than the call) must run and give the right result.
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
LARGEST = 2**63 - 1  # int64's largest: tile sizes past a call's length


def good_forward(b=B, h=H, hkv=HKV, lq=LQ, lk=LK, d=D, dv=DV) -> dict:
    """A valid forward call: relation bias, Toeplitz gate, both masks, documents, relu2, GQA."""
    gen = torch.Generator().manual_seed(0)
    return dict(
        q=torch.randn(b, h, lq, d, generator=gen, **F64),
        k=torch.randn(b, hkv, lk, d, generator=gen, **F64),
        v=torch.randn(b, hkv, lk, dv, generator=gen, **F64),
        bias_kind=KINDS["relation"],
        bias=torch.randn(h, R, generator=gen, **F64),
        bias_index=torch.randint(0, R, (1, lq, lk), generator=gen),
        gate_kind=KINDS["toeplitz"],
        gate=torch.rand(1, lq + lk - 1 + LANES, generator=gen, **F64),
        gate_index=None,
        float_mask=torch.randn(1, h, lq, lk, generator=gen, **F64),
        bool_mask=torch.rand(lq, lk, generator=gen)[None, None] < 0.8,
        key_padding=torch.rand(b, lk, generator=gen) < 0.2,
        documents=torch.randint(0, 3, (b, lk), generator=gen),
        fixed=torch.full((b, h, lq), float(max(lk, 1)), **F64),
        causal=True,
        norm=NORMS["relu2"],
        scale=0.3,
        dropout_p=0.0,
        dropout_threshold=0,
        dropout_seed=None,
        block_q=2,
        block_k=4,
    )


def good_backward(**sizes) -> dict:
    call = good_forward(**sizes)
    b, h, lq, dv = call["q"].shape[:3] + call["v"].shape[3:]
    gen = torch.Generator().manual_seed(1)
    return dict(
        grad_out=torch.randn(b, h, lq, dv, generator=gen, **F64),
        stat=call["fixed"].clone(),
        out=torch.randn(b, h, lq, dv, generator=gen, **F64),
        **call,
        needs_bias=True,
        needs_gate=True,
        needs_mask=True,
        items_per_thread=4,
    )


def good_forward_if_finite(**sizes) -> dict:
    """forward_if_finite takes no documents, statistic or dropout: softmax here."""
    call = good_forward(**sizes)
    for name in ("documents", "fixed", "dropout_p", "dropout_threshold", "dropout_seed"):
        del call[name]
    return dict(call, norm=NORMS["softmax"])


GOOD = {
    "forward": good_forward,
    "backward": good_backward,
    "forward_if_finite": good_forward_if_finite,
    "exp_values": lambda: dict(x=torch.zeros(3, **F64)),
}


def _rows_far_apart() -> torch.Tensor:
    """q whose two rows lie 2^31 entries apart (BLAS's int would wrap): 8 GB of address space,
    two pages of it touched."""
    memory = torch.empty(2**31 + D)
    return memory.as_strided((1, 1, 2, D), (0, 0, 2**31, 1)).fill_(1.0)


def _expanded(*shape: int) -> torch.Tensor:
    """A tensor of `shape` read from one (1, 1, L, E) block (no memory for its leading dims)."""
    return torch.zeros(1, 1, *shape[2:], **F64).expand(*shape)


def _index(value: int) -> torch.Tensor:
    index = torch.zeros(1, LQ, LK, dtype=torch.int64)
    index[0, LQ - 1, LK - 1] = value
    return index


# a call without terms, masks or documents (for operands of other sizes than the good call's)
PLAIN = dict(
    bias_kind=0,
    gate_kind=0,
    float_mask=None,
    bool_mask=None,
    key_padding=None,
    documents=None,
    fixed=None,
    norm=NORMS["softmax"],
)

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
    # read entry by entry along the keys: a last dim of 1 is not a broadcast
    "documents of one key": ("forward", dict(documents=torch.zeros(B, 1, dtype=torch.int64))),
    "backward documents of one key": (
        "backward",
        dict(documents=torch.zeros(1, 1, dtype=torch.int64)),
    ),
    "decay of one key": (
        "forward",
        dict(bias_kind=KINDS["decay"], bias=torch.zeros(B, H, 1, **F64)),
    ),
    "backward decay of one key": (
        "backward",
        dict(bias_kind=KINDS["decay"], bias=torch.zeros(1, 1, 1, **F64)),
    ),
    "forward_if_finite decay of one key": (
        "forward_if_finite",
        dict(bias_kind=KINDS["decay"], bias=torch.zeros(1, H, 1, **F64)),
    ),
    "forward_if_finite k rank": ("forward_if_finite", dict(k=torch.zeros(LK * D, **F64))),
    # a float32 forward reads a cross decay's float64 sums; a gradient needs them in float32
    "backward float64 cross decay of a float32 call": (
        "backward",
        dict(
            PLAIN,
            q=torch.zeros(B, H, LQ, D),
            k=torch.zeros(B, HKV, LK, D),
            v=torch.zeros(B, HKV, LK, DV),
            grad_out=torch.zeros(B, H, LQ, DV),
            stat=torch.ones(B, H, LQ),
            out=torch.zeros(B, H, LQ, DV),
            bias_kind=6,
            bias=torch.zeros(B, H, LQ + LK, **F64),
            bias_index=None,
            gate=None,
        ),
    ),
    "items_per_thread 0": ("backward", dict(items_per_thread=0)),
    "items_per_thread negative": ("backward", dict(items_per_thread=-3)),
    "dropout threshold negative": (
        "forward",
        dict(dropout_p=0.5, dropout_threshold=-1, dropout_seed=torch.tensor(3)),
    ),
    "dropout threshold past 2^32": (
        "forward",
        dict(dropout_p=0.5, dropout_threshold=2**40, dropout_seed=torch.tensor(3)),
    ),
    "dropout seed complex": (
        "forward",
        dict(dropout_p=0.5, dropout_threshold=2**31, dropout_seed=torch.tensor(1 + 2j)),
    ),
    "exp_values of a meta tensor": ("exp_values", dict(x=torch.zeros(3, device="meta"))),
    "sizes past int64": (  # B * H * Lq * Lk = 2^70 weights, from tensors of at most 2^60
        "forward",
        dict(
            q=lambda: _expanded(2**40, 2**20, 1, 1),
            k=lambda: _expanded(2**40, 1, 2**10, 1),
            v=lambda: _expanded(2**40, 1, 2**10, 1),
            **PLAIN,
        ),
    ),
    "q rows 2^31 apart": (
        "forward",
        dict(
            q=_rows_far_apart,
            k=lambda: torch.ones(1, 1, LK, D),
            v=lambda: torch.ones(1, 1, LK, DV),
            **PLAIN,
        ),
    ),
}


# name -> (op, sizes of the good call, changes): valid calls at the edges, which must run and
# give the result written beside them (`_check`)
EDGE_CALLS = {
    # empty dims: empty outputs, zeros where a query sees no key, zero gradients
    "forward with batch 0": ("forward", dict(b=0), {}),
    "forward with no heads": ("forward", dict(h=0), {}),
    "forward with no queries": ("forward", dict(lq=0), {}),
    "forward with no keys": ("forward", dict(lk=0), {}),
    "backward with batch 0": ("backward", dict(b=0), {}),
    "backward with no heads": ("backward", dict(h=0), {}),
    "backward with no queries": ("backward", dict(lq=0), {}),
    "backward with no keys": ("backward", dict(lk=0), {}),
    "forward_if_finite with batch 0": ("forward_if_finite", dict(b=0), {}),
    # tiles longer than the call: the tiles of the whole call
    "forward with the largest tiles": ("forward", {}, dict(block_q=LARGEST, block_k=LARGEST)),
    "backward with the largest tiles": ("backward", {}, dict(block_q=LARGEST, block_k=LARGEST)),
    "forward_if_finite with the largest tiles": (
        "forward_if_finite",
        {},
        dict(block_q=LARGEST, block_k=LARGEST),
    ),
    "backward with the largest items_per_thread": (
        "backward",
        {},
        dict(items_per_thread=LARGEST),
    ),
}


def _check(op: str, sizes: dict, result) -> str:
    """'' if an edge call's result is right, else what is wrong."""
    if sizes:  # empty dims: every output empty or 0 (the forward's row statistic aside)
        if op == "forward_if_finite" and not result[1]:
            return "no result"
        outputs = list(result) if op == "backward" else [result[0]]
        wrong = [tuple(t.shape) for t in outputs if not torch.equal(t, torch.zeros_like(t))]
        return f"non-zero outputs of shapes {wrong}" if wrong else ""
    whole = dict(GOOD[op](), block_q=LQ, block_k=LK)  # one tile: the call as it is
    expected = getattr(torch.ops.urpe_cpp, op)(**whole)
    for got, want in zip(result, expected, strict=True):
        if torch.is_tensor(want) and not torch.allclose(got, want, rtol=1e-12, atol=1e-12):
            return f"differs from one whole tile by {(got - want).abs().max().item():.3g}"
    return ""


def run_calls(names) -> None:
    """The child: each call in turn, one JSON line each ({"name", "outcome", "message"})."""
    assert unavailable() is None, unavailable()
    for name in names:
        if name.startswith("good"):
            op, sizes, changes = name.split()[1], {}, {}
        elif name in EDGE_CALLS:
            op, sizes, changes = EDGE_CALLS[name]
        else:
            (op, changes), sizes = BAD_CALLS[name], {}
        try:
            changes = {key: value() if callable(value) else value for key, value in changes.items()}
        except RuntimeError as error:  # this machine cannot reserve the memory the case needs
            print(json.dumps(dict(name=name, outcome="skipped", message=str(error))), flush=True)
            continue
        call = dict(GOOD[op](**sizes), **changes)
        try:
            result = getattr(torch.ops.urpe_cpp, op)(**call)
            outcome, message = "ok", ""
            if name in EDGE_CALLS:
                message = _check(op, sizes, result)
                outcome = "wrong" if message else "ok"
        except Exception as error:  # noqa: BLE001 - what it raised is the finding
            outcome, message = type(error).__name__, str(error).splitlines()[0]
        print(json.dumps(dict(name=name, outcome=outcome, message=message)), flush=True)


GOOD_CALLS = ["good forward", "good backward", "good forward_if_finite", "good exp_values"]
ALL_CALLS = [*GOOD_CALLS, *EDGE_CALLS, *BAD_CALLS]


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
            if not line.startswith("{"):  # (BLAS prints its own complaints to stdout)
                continue
            record = json.loads(line)
            found[record["name"]] = (record["outcome"], record["message"])
        if result.returncode != 0 and len(found) < len(ALL_CALLS):  # this call killed it
            found[ALL_CALLS[len(found)]] = ("crash", f"exit status {result.returncode}")
    return found


@pytest.mark.parametrize("name", GOOD_CALLS)
def test_the_valid_call_runs(outcomes, name):
    assert outcomes.get(name) == ("ok", ""), outcomes.get(name)


@pytest.mark.parametrize("name", list(EDGE_CALLS))
def test_a_valid_call_at_the_edges_runs_and_is_right(outcomes, name):
    assert outcomes.get(name) == ("ok", ""), outcomes.get(name)


@pytest.mark.parametrize("name", list(BAD_CALLS))
def test_a_bad_raw_call_raises_a_clear_error(outcomes, name):
    outcome, message = outcomes[name]
    if outcome == "skipped":
        pytest.skip(message)
    assert outcome == "RuntimeError" and "urpe_cpp" in message, (outcome, message)


if __name__ == "__main__":
    run_calls(ALL_CALLS[int(sys.argv[1]) :])
