"""The Triton kernels compile for real GPUs (sm_80, sm_90), ahead of time, without one, and
the autotuner's configurations spill nothing in half precision.

Triton's CPU interpreter accepts code that the GPU compiler refuses (it once let the kernels read
a plain-int module global, which broke every CUDA launch) and knows nothing of registers, so the
interpreter tests alone cannot show that the kernels build, or build well. `urpe bench compile`
compiles them down to the cubin with the `ptxas` Triton bundles, in worker processes without
TRITON_INTERPRET (set by conftest), and reads registers, spills and shared memory back.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch
import triton

from urpe.bench.compile import (
    KERNELS,
    ONCE_SPILLED,
    STRENGTH,
    Case,
    compile_cases,
    feature_rows,
    full_matrix,
    launch_factors,
    launch_of,
    problems,
    quick_matrix,
)
from urpe.bench.covering import all_combinations, covered
from urpe.kernels.triton import launch


def _check(cases, jobs=1):
    records = compile_cases(cases, jobs=jobs)
    assert len(records) == len(cases)
    found = problems(records)  # compile errors, shared memory over the limit, fp16/bf16 spills
    assert not found, "\n".join(found)
    wide = [r for r in records if r["ok"] and r["dtype"] in ("float32", "float64")]
    heavy = [r for r in wide if r["spill_bytes"] >= 1024]
    assert not heavy, "\n".join(f"{r['kernel']} {r['dtype']}: {r['spill_bytes']} B" for r in heavy)


def test_quick_subset_compiles_for_sm80_and_sm90_without_spills():
    """Includes the launches that once spilled (`ONCE_SPILLED`) on sm_80."""
    cases = quick_matrix()
    assert {c.kernel for c in cases} == {"forward", "backward_kv", "backward_q", "dropout_mask"}
    assert {c.arch for c in cases} == {80, 90}
    for kernel, features in ONCE_SPILLED:
        sm80 = [c for c in cases if (c.kernel, c.arch, c.dtype) == (kernel, 80, "bfloat16")]
        assert any(all(getattr(c, n) == v for n, v in features.items()) for c in sm80)
    _check(cases)


@pytest.mark.slow
def test_every_autotuner_configuration_compiles_without_spills():
    _check(full_matrix(), jobs=os.cpu_count() or 1)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_matrix_holds_every_pair_of_launch_features(kernel, dtype):
    """Not a hand list: the rows cover every pair of values of the features `launch_factors`
    reads off the launch code, and every such row is compiled at every configuration."""
    factors = launch_factors(kernel, dtype)
    rows = feature_rows(kernel, dtype)
    assert covered(rows, factors, STRENGTH) == all_combinations(factors, STRENGTH)
    cases = full_matrix(archs=(80,), dtypes=(dtype,))
    for row in rows:
        variant = (row["bias"] == "decay" and row.get("bias_grad", True), row["documents"])
        for blocks in launch.configs_for(kernel, 64, launch.dtype_family(dtype), *variant):
            assert Case(kernel, 80, dtype, 64, blocks, **row) in cases


# constexpr arguments set by the dtype (accumulator, product precision, interpreter upcast),
# the head dims and the tile configuration rather than by a feature of the call
NOT_FEATURES = {"ACC", "PRECISION", "UPCAST", "BLOCK_D", "BLOCK_DV"}


@pytest.mark.parametrize("kernel", KERNELS)
def test_every_constexpr_of_a_launch_is_a_feature_of_the_matrix(kernel):
    """A launch's constexpr flags each follow one of `launch_factors`' features: a new flag in
    the launch code fails here until the compile matrix varies it."""
    base = Case(
        kernel,
        80,
        "float32",
        64,
        (16, 32, 4, 2),
        causal=False,
        dropout=False,
        padding=False,
        mask=False,
    )
    meta = launch_of(base).meta
    varied = set()
    for name, values in launch_factors(kernel, "float32").items():
        for value in values:
            other = launch_of(replace(base, **{name: value})).meta
            varied |= {key for key in meta if other[key] != meta[key]}
    assert varied == set(meta) - NOT_FEATURES


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
    `urpe bench compile` reports on)."""
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
    assert {c.maxnreg for c in kept} == {launch.MAX_REGISTERS}  # what `urpe bench compile` uses
