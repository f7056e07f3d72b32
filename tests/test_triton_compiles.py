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

from urpe.bench.compile import compile_cases, full_matrix, problems, quick_matrix


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
