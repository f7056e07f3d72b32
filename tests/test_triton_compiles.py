"""The Triton kernels compile for real GPUs (sm_80, sm_90), ahead of time, without one.

Triton's CPU interpreter accepts code that the GPU compiler refuses (it once let the kernels read
a plain-int module global, which broke every CUDA launch), so the interpreter tests alone cannot
show that the kernels build. Triton compiles for a CUDA target on a machine without a GPU, down
to the cubin with the `ptxas` it bundles; that runs in a child process, because a process with
TRITON_INTERPRET=1 (set by conftest) only has interpreted kernels.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

# One configuration of each kernel: Toeplitz bias and gate (every code path that reads a term),
# softmax, causal, padding and a bool mask, dropout, bf16, D = 64.
_CHILD = textwrap.dedent(
    """
    import json, sys
    import triton, triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from urpe.kernels.triton import kernels as K

    POINTERS = {"stat_ptr": "*fp32", "delta_ptr": "*fp32", "pad_ptr": "*u8", "mask_ptr": "*u8",
                "keep_ptr": "*u8", "B_idx": "*i64", "C_idx": "*i64", "dB_ptr": "*fp32",
                "dC_ptr": "*fp32"}
    FLOATS = ("scale", "dropout_p")

    def signature(fn, constexprs):
        sig = {}
        for name in fn.arg_names:
            if name in constexprs:
                sig[name] = "constexpr"
            elif name in POINTERS:
                sig[name] = POINTERS[name]
            elif name.endswith("_ptr"):
                sig[name] = "*bf16"
            elif name in FLOATS:
                sig[name] = "fp32"
            else:
                sig[name] = "i32"
        return sig

    common = dict(B_KIND=1, C_KIND=1, NORM=0, CAUSAL=True, HAS_PAD=True, HAS_MASK=True,
                  DROPOUT=True, ACC=tl.float32, PRECISION=None, UPCAST=False, BLOCK_D=64,
                  BLOCK_DV=64, BLOCK_M=64, BLOCK_N=64)
    jobs = [
        (K.attention_fwd_kernel, common),
        (K.attention_bwd_kv_kernel, dict(common, B_GRAD=True, C_GRAD=True, WIDTH=128)),
        (K.attention_bwd_q_kernel, common),
        (K.dropout_mask_kernel, dict(BLOCK_M=16, BLOCK_N=16)),
    ]
    results = []
    for arch in (80, 90):
        for fn, constexprs in jobs:
            src = ASTSource(fn=fn, signature=signature(fn, constexprs), constexprs=constexprs)
            try:
                compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                                          options=dict(num_warps=4, num_stages=2))
                ok, error = bool(compiled.asm.get("cubin")), None
            except Exception as exc:  # noqa: BLE001 - reported to the test
                ok, error = False, f"{type(exc).__name__}: {str(exc)[-600:]}"
            results.append(dict(kernel=fn.__name__, arch=arch, ok=ok, error=error))
    json.dump(results, sys.stdout)
    """
)


def test_every_kernel_compiles_for_sm80_and_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    env.pop("TRITON_ALLOW_NON_CONSTEXPR_GLOBALS", None)
    done = subprocess.run(
        [sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=600
    )
    if done.returncode:
        pytest.fail(f"the compile child failed:\n{done.stderr[-3000:]}")
    results = json.loads(done.stdout)
    assert len(results) == 8
    failed = [r for r in results if not r["ok"]]
    assert not failed, "\n".join(f"{r['kernel']} sm_{r['arch']}: {r['error']}" for r in failed)
