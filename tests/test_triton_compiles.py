"""The Triton kernels compile for real GPUs (sm_80, sm_90), ahead of time, without one, and
the autotuner's configurations spill nothing in half precision.

Triton's CPU interpreter accepts code that the GPU compiler refuses (it once let the kernels read
a plain-int module global, which broke every CUDA launch) and knows nothing of registers, so the
interpreter tests alone cannot show that the kernels build, or build well. The compile matrix
(benchmarks/harness/compile_matrix.py) compiles what the public call launches down to the cubin
with the `ptxas` Triton bundles, in worker processes without TRITON_INTERPRET (set by conftest),
and reads registers, spills and shared memory back.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch
import triton

from harness.compile_matrix import (
    KERNELS,
    NAMED,
    STRENGTH,
    calls,
    compile_cases,
    factors,
    full_matrix,
    problems,
    quick_matrix,
)
from harness.covering import all_combinations, covered
from harness.launches import Call, recorded
from urpe.kernels.triton import launch


def _check(cases, jobs=1):
    records = compile_cases(cases, jobs=jobs)
    assert len(records) == len(cases)
    found = problems(records)  # compile errors, shared memory over the limit, fp16/bf16 spills
    assert not found, "\n".join(found)
    wide = [r for r in records if r["ok"] and r["dtype"] in ("float32", "float64")]
    heavy = [r for r in wide if r["spill_bytes"] >= 1024]
    assert not heavy, "\n".join(f"{r['kernel']} {r['dtype']}: {r['spill_bytes']} B" for r in heavy)


@pytest.mark.slow
def test_quick_subset_compiles_for_sm80_and_sm90_without_spills():
    """Includes the dK/dV launches of the calls that once spilled (`NAMED`) on sm_80."""
    cases = quick_matrix()
    assert {c.kernel for c in cases} == {"forward", "backward_kv", "backward_q", "dropout_mask"}
    assert {c.arch for c in cases} == {80, 90}
    # every NAMED call's dK/dV launch is compiled for sm_80 (under the first call that made
    # it: two calls may launch the same program)
    compiled = {(c.launch.program(), c.arch) for c in cases}
    named = [Call(dtype="bfloat16", **features) for features in NAMED.values()]
    launched = recorded(named)
    for call in named:
        dkdv = [launch for launch in launched[call] if launch.kernel == "backward_kv"]
        assert dkdv and all((launch.program(), 80) in compiled for launch in dkdv), call
    _check(cases)


@pytest.mark.slow
def test_every_autotuner_configuration_compiles_without_spills():
    _check(full_matrix(), jobs=os.cpu_count() or 1)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_calls_hold_every_pair_of_call_features(dtype):
    """Not a hand list: the calls cover every pair of values of the features a user chooses,
    in every dtype and head-dim bucket, and the NAMED calls stand beside them in half
    precision."""
    made = calls(dtypes=(dtype,))
    for d in (64, 128):
        chosen = factors(dtype, d)
        rows = [
            {name: getattr(c, name) for name in chosen}
            for c in made
            if c.head_dim in chosen["head_dim"]
        ]
        # (the NAMED calls may add pairs of values beyond the factors' levels, G=2 among them)
        assert covered(rows, chosen, STRENGTH) >= all_combinations(chosen, STRENGTH)
    named = {Call(dtype=dtype, **features) for features in NAMED.values()}
    assert named <= set(made) if dtype == "bfloat16" else not named & set(made)


# constexpr arguments set by the dtype (accumulator, product precision, interpreter upcast)
# and the head dims rather than by a feature of the call
NOT_FEATURES = {"ACC", "UPCAST", "BLOCK_D", "BLOCK_DV"}


@pytest.mark.slow
@pytest.mark.parametrize("kernel", KERNELS)
def test_every_constexpr_of_a_launch_is_varied_by_the_calls(kernel):
    """A launch's constexpr arguments each change with one of `factors`' features: a new flag
    in the launch code fails here until the calls vary it."""
    base = Call(dtype="float32", head_dim=16, lq=32, lk=32)
    skip = ("lq", "lk", "head_dim")  # integers, not constexprs: 32 and 16 keep it quick
    others = [
        replace(base, **{name: value})
        for name, values in factors("float32", 16).items()
        if name not in skip
        for value in values
    ]
    found = recorded([base, *others])
    first = next(x for x in found[base] if x.kernel == kernel).constants
    varied = set()
    for call in others:
        other = next(x for x in found[call] if x.kernel == kernel).constants
        varied |= {key for key in first if other[key] != first[key]}
    assert varied == set(first) - NOT_FEATURES


@pytest.mark.slow
def test_a_launch_is_recorded_as_the_kernel_receives_it():
    """The recorded launch holds the call's own integers and alignments: a grouped call's
    heads per kv head, a Toeplitz table's reach, and q, k, v of a (B, L, H, D) projection."""
    call = Call(dtype="bfloat16", head_dim=40, bias="toeplitz", groups=4, lq=48, lk=48,
                layout="blhd", table="clamped")  # fmt: skip
    forward = next(x for x in recorded([call])[call] if x.kernel == "forward")
    names = [n for n in launch.KERNELS["forward"].arg_names if n not in forward.constants]
    names = [n for n in names if n not in ("BLOCK_M", "BLOCK_N")]
    args = dict(zip(names, forward.args, strict=True))
    assert args["group"] == ("int", 4) and args["heads"] == ("int", 8)
    assert args["B_K"] == ("int", 128)  # the table's maximum distance
    assert args["sqm"] == ("int", 8 * 40) and args["sqh"] == ("int", 40)  # (B, L, H, D) strides
    assert args["q_ptr"] == ("tensor", "bfloat16", True)
    assert forward.constants["UPCAST"] is False  # as on a GPU, not as the interpreter runs it


@pytest.mark.parametrize(
    ("kernel", "decay_grad", "documents"),
    [
        (kernel, decay, docs)
        for kernel in ("forward", "backward_kv", "backward_q")
        for decay, docs in ((False, False), (True, False), (False, True), (True, True))
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("head_dim", [16, 64, 128, 256])
def test_the_autotuner_tries_exactly_the_checked_configurations(
    kernel, decay_grad, documents, dtype, head_dim
):
    """The autotuner's pruning keeps, per head dim, dtype and variant (a Decay's gradient,
    document ids), the configurations the compile checks above cover (and that list is what
    the compile matrix reports on)."""
    from urpe.kernels.triton import kernels as K

    tuner = launch.tuned(kernel)
    block_d = max(16, triton.next_power_of_2(head_dim))
    named = {"q_ptr": torch.empty(0, dtype=dtype)}
    grad = K.DECAY.value if decay_grad else K.NO_TERM.value
    kept = tuner.early_config_prune(
        tuner.configs, named, BLOCK_D=block_d, BLOCK_DV=block_d, B_GRAD=grad, DOCS=documents
    )
    shapes = [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in kept]
    expected = launch.configs_for(
        kernel, block_d, launch.dtype_family(dtype), decay_grad, documents
    )
    assert sorted(shapes) == sorted(expected)
    assert {c.maxnreg for c in kept} == {launch.MAX_REGISTERS}  # what the compile matrix uses
