"""The Triton kernels compile for real GPUs (sm_80, sm_90), ahead of time, without one, and
the autotuner's configurations spill nothing in half precision.

Triton's CPU interpreter accepts code that the GPU compiler refuses (it once let the kernels read
a plain-int module global, which broke every CUDA launch) and knows nothing of registers, so the
interpreter tests alone cannot show that the kernels build, or build well. `urpe bench compile`
compiles them down to the cubin with the `ptxas` Triton bundles, in worker processes without
TRITON_INTERPRET (set by conftest), and reads registers, spills and shared memory back.
"""

from __future__ import annotations

import pytest
import torch
import triton

from urpe.bench.compile import compile_cases, full_matrix, problems, quick_matrix
from urpe.kernels.triton import launch


def _check(cases):
    records = compile_cases(cases, jobs=1)
    assert len(records) == len(cases)
    found = problems(records)  # compile errors, shared memory over the limit, fp16/bf16 spills
    assert not found, "\n".join(found)
    wide = [r for r in records if r["ok"] and r["dtype"] in ("float32", "float64")]
    heavy = [r for r in wide if r["spill_bytes"] >= 1024]
    assert not heavy, "\n".join(f"{r['kernel']} {r['dtype']}: {r['spill_bytes']} B" for r in heavy)


def test_quick_subset_compiles_for_sm80_and_sm90_without_spills():
    cases = quick_matrix()
    assert {c.kernel for c in cases} == {"forward", "backward_kv", "backward_q", "dropout_mask"}
    assert {c.arch for c in cases} == {80, 90}
    _check(cases)


@pytest.mark.slow
def test_every_autotuner_configuration_compiles_without_spills():
    _check(full_matrix())


@pytest.mark.parametrize("kernel", ["forward", "backward_kv", "backward_q"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("head_dim", [16, 64, 128, 256])
def test_the_autotuner_tries_exactly_the_checked_configurations(kernel, dtype, head_dim):
    """The autotuner's pruning keeps, per head dim and dtype, the configurations the compile
    checks above cover (and that list is what `urpe bench compile` reports on)."""
    tuner = launch.tuned(kernel)
    block_d = max(16, triton.next_power_of_2(head_dim))
    named = {"q_ptr": torch.empty(0, dtype=dtype)}
    kept = tuner.early_config_prune(tuner.configs, named, BLOCK_D=block_d, BLOCK_DV=block_d)
    shapes = [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in kept]
    expected = launch.configs_for(kernel, block_d, launch.dtype_family(dtype))
    assert sorted(shapes) == sorted(expected)
