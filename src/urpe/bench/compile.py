"""`urpe bench compile`: compile every Triton kernel for real GPUs ahead of time, without one.

Triton's CPU interpreter accepts what the GPU compiler refuses and knows nothing of registers or
shared memory, so the interpreter tests cannot show that the kernels build, or build well. Triton
compiles for a CUDA target on any machine, down to the cubin with the `ptxas` it bundles; the
bundled `cuobjdump --dump-resource-usage` then reports registers and stack per thread (a stack
frame is where ptxas spills registers). One line per configuration:

    backward_kv  sm_90 bfloat16 D=64  64x64 w4 s2 toeplitz/toeplitz softmax causal dropout ...
        ok  reg 232  spill     0  smem  49152

The arguments are the ones the library launches with: each case builds `ForwardArgs` on meta
tensors and asks `urpe.kernels.triton.ops` for its launches, then specialises them as Triton's
launcher does (a stride of 1 becomes a constant, pointers and multiples of 16 are aligned).
Compilation runs in worker processes without TRITON_INTERPRET (a process that has it has only
interpreted kernels). The tile configurations are the autotuner's own (`launch.CONFIGS`).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

import torch

ARCHS = (80, 90)
DTYPES = ("float16", "bfloat16", "float32", "float64")
HEAD_DIMS = (64, 128)
KERNELS = ("forward", "backward_kv", "backward_q")
TERM_KINDS = ("none", "toeplitz", "relation", "dense")
NORMALIZATIONS = ("softmax", "exp", "l2", "relu2")
# Shared memory a block may use (opt-in maximum), bytes.
SHARED_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}
SHAPE = dict(batch=2, heads=8, length=1024)  # what the launches are specialised on


@dataclass(frozen=True)
class Case:
    """One compilation: a kernel, a target, a dtype, a head dim, a tile configuration
    (BLOCK_M, BLOCK_N, num_warps, num_stages) and the variant's kinds."""

    kernel: str
    arch: int
    dtype: str
    head_dim: int
    blocks: tuple[int, int, int, int]
    bias: str = "toeplitz"
    gate: str = "toeplitz"
    normalization: str = "softmax"
    causal: bool = True
    dropout: bool = True
    padding: bool = True
    mask: bool = True

    def label(self) -> str:
        m, n, w, s = self.blocks
        if self.kernel == "dropout_mask":
            return f"{self.kernel:<12} sm_{self.arch} {m}x{n} w{w} s{s}"
        flags = [f for f, on in (("causal", self.causal), ("dropout", self.dropout),
                                 ("pad", self.padding), ("mask", self.mask)) if on]  # fmt: skip
        return (f"{self.kernel:<12} sm_{self.arch} {self.dtype:<8} D={self.head_dim:<3} "
                f"{m}x{n} w{w} s{s} {self.bias}/{self.gate} {self.normalization} "
                f"{' '.join(flags)}")  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Which cases


def kept_blocks(kernel: str, head_dim: int, dtype: str) -> tuple:
    """The autotuner's configurations for this kernel, head dim and dtype."""
    from ..kernels.triton.launch import configs_for, dtype_family

    if kernel == "dropout_mask":
        return ((16, 16, 4, 1),)
    return configs_for(kernel, head_dim, dtype_family(dtype))


def _variants(kernel: str) -> list[dict]:
    """The kinds each (kernel, target, dtype, D, tiles) is compiled with: every bias/gate kind
    as bias and as gate with every mask, causal and dropout on (the most code), every other
    normalisation, and the lightest variant (no term, no mask)."""
    if kernel == "dropout_mask":
        return [{}]
    pairs = [("toeplitz", "toeplitz"), ("relation", "dense"), ("dense", "relation")]
    heavy = [dict(bias=b, gate=g) for b, g in pairs]
    norms = [dict(normalization=n) for n in NORMALIZATIONS[1:]]
    light = [dict(bias="none", gate="none", causal=False, dropout=False, padding=False,
                  mask=False)]  # fmt: skip
    return heavy + norms + light


def full_matrix(archs=ARCHS, dtypes=DTYPES) -> list[Case]:
    """Every kernel x target x dtype x D x autotuner configuration x variant."""
    cases = []
    for kernel in (*KERNELS, "dropout_mask"):
        for arch, dtype, d in itertools.product(archs, dtypes, HEAD_DIMS):
            if kernel == "dropout_mask" and (dtype, d) != (DTYPES[0], HEAD_DIMS[0]):
                continue
            for blocks, variant in itertools.product(
                kept_blocks(kernel, d, dtype), _variants(kernel)
            ):
                cases.append(Case(kernel, arch, dtype, d, blocks, **variant))
    return cases


def quick_matrix(archs=ARCHS) -> list[Case]:
    """A representative subset (20 compilations, about 2 to 3 minutes on one core): the heaviest
    variant (Toeplitz bias and gate, causal, padding, bool mask, dropout) at the autotuner's first
    configuration per kernel x target x D in bf16 (fp16 compiles to the same registers), one
    fp32 case per kernel, and the dropout-mask kernel."""
    cases = []
    for kernel, arch in itertools.product(KERNELS, archs):
        for dtype, d in (("bfloat16", 64), ("bfloat16", 128)):
            for blocks in kept_blocks(kernel, d, dtype)[:1]:
                cases.append(Case(kernel, arch, dtype, d, blocks))
        cases.append(Case(kernel, arch, "float32", 64, kept_blocks(kernel, 64, "float32")[0]))
        cases.append(Case("dropout_mask", arch, "float16", 64, (16, 16, 4, 1)))
    return list(dict.fromkeys(cases))


# ---------------------------------------------------------------------------------------------
# One compilation (runs in a worker process)


def _term(kind: str, b: int, h: int, length: int, dtype) -> tuple:
    """(tensor, index) of a bias or gate on the meta device."""
    meta = dict(device="meta", dtype=dtype)
    if kind == "toeplitz":
        return torch.empty(h, 2 * length - 1, **meta), None
    if kind == "relation":
        index = torch.empty(b, length, length, device="meta", dtype=torch.int64)
        return torch.empty(h, 64, **meta), index
    if kind == "dense":
        return torch.empty(b, h, length, length, **meta), None
    return None, None


def launch_of(case: Case):
    """The library's own `Launch` for this case (meta tensors, the shape in SHAPE)."""
    from ..kernels.layout import BackwardArgs, ForwardArgs
    from ..kernels.triton import ops

    b, h, n = SHAPE["batch"], SHAPE["heads"], SHAPE["length"]
    dtype = getattr(torch, case.dtype)
    q, k, v = (torch.empty(b, h, n, case.head_dim, device="meta", dtype=dtype) for _ in "qkv")
    bias, bias_index = _term(case.bias, b, h, n, dtype)
    gate, gate_index = _term(case.gate, b, h, n, dtype)
    mask = torch.empty(b, 1, n, n, device="meta", dtype=torch.bool) if case.mask else None
    padding = torch.empty(b, n, device="meta", dtype=torch.bool) if case.padding else None
    seed = torch.tensor(2**61 + 12345)  # drawn seeds are int64
    args = ForwardArgs(
        q, k, v, bias, bias_index, gate, gate_index, mask, padding, seed, case.bias, case.gate,
        case.causal, case.normalization, case.head_dim**-0.5, 0.1 if case.dropout else 0.0, 0, 0,
    )  # fmt: skip
    if case.kernel == "forward":
        return ops.forward_launch(args)[0]
    launches = ops.backward_launches(BackwardArgs(q, q, q.new_empty(b, h, n), args, 1, 1, 0))
    return launches[0] if case.kernel == "backward_kv" else launches[1]


def _source(case: Case):
    """(jit function, signature, constexprs, attrs) as Triton's launcher would build them."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend

    from ..kernels.triton import kernels as K
    from ..kernels.triton.launch import KERNELS as FUNCTIONS
    from ..kernels.triton.launch import tile_meta

    m, n = case.blocks[:2]
    if case.kernel == "dropout_mask":
        keep = torch.empty(1, device="meta", dtype=torch.uint8)
        fn, values = K.dropout_mask_kernel, (keep, 2**61 + 12345, 0, 1024, 1024, 8, 0.1)
        meta = dict(BLOCK_M=m, BLOCK_N=n)
    else:
        launch = launch_of(case)
        fn, values = FUNCTIONS[case.kernel], launch.args
        meta = dict(launch.meta, **tile_meta(case.kernel, m, n))
    signature, constexprs, attrs = {}, dict(meta), {}
    runtime = [name for name in fn.arg_names if name not in meta]
    assert len(runtime) == len(values), (case.kernel, len(runtime), len(values))
    for name, value in zip(runtime, values, strict=True):
        specialize = name not in getattr(fn, "do_not_specialize", ())
        kind, attr = native_specialize_impl(CUDABackend, value, False, specialize, True)
        signature[name] = kind
        if kind == "constexpr":
            constexprs[name] = value
        elif isinstance(attr, str) and "D" in attr:
            attrs[(fn.arg_names.index(name),)] = [["tt.divisibility", 16]]
    for name in meta:
        signature[name] = "constexpr"
    signature = {name: signature[name] for name in fn.arg_names}
    return fn, signature, constexprs, attrs


def _cuobjdump() -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump")


def resource_usage(cubin: bytes) -> dict:
    """REG, STACK, LOCAL, SHARED of the (single) function in a cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        text = subprocess.run(
            [_cuobjdump(), "--dump-resource-usage", file.name],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
    return {key: int(value) for key, value in re.findall(r"\b(REG|STACK|LOCAL|SHARED):(\d+)", text)}


def compile_case(case: Case) -> dict:
    """Compile one case; the JSON record (see the command's help)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    tiles = dict(zip(("block_m", "block_n", "num_warps", "num_stages"), case.blocks, strict=True))
    record = dict(kernel=case.kernel, arch=case.arch, dtype=case.dtype, head_dim=case.head_dim,
                  config=dict(tiles,
                              bias=case.bias, gate=case.gate, normalization=case.normalization,
                              causal=case.causal, dropout=case.dropout, padding=case.padding,
                              mask=case.mask),
                  ok=False, error=None, registers=None, spill_bytes=None, shared_bytes=None,
                  seconds=None)  # fmt: skip
    start = time.perf_counter()
    try:
        fn, signature, constexprs, attrs = _source(case)
        source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
        options = dict(num_warps=case.blocks[2], num_stages=case.blocks[3])
        compiled = triton.compile(source, target=GPUTarget("cuda", case.arch, 32), options=options)
        usage = resource_usage(compiled.asm["cubin"])
        shared = max(int(compiled.metadata.shared), usage.get("SHARED", 0))
        record.update(registers=usage.get("REG"), shared_bytes=shared,
                      spill_bytes=usage.get("STACK", 0) + usage.get("LOCAL", 0))  # fmt: skip
        limit = SHARED_LIMIT.get(case.arch)
        if limit is not None and shared > limit:
            record["error"] = f"shared memory {shared} B > the sm_{case.arch} limit {limit} B"
        else:
            record["ok"] = True
    except Exception as error:  # noqa: BLE001 - a compile error is this tool's finding
        lines = [line for line in str(error).splitlines() if line.strip()]
        record["error"] = f"{type(error).__name__}: {' | '.join(lines[-3:])[:500]}"
    record["seconds"] = round(time.perf_counter() - start, 2)
    return record


def _worker_setup() -> None:
    # before triton is imported here: an interpreting process builds no GPU code
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ.pop("TRITON_ALLOW_NON_CONSTEXPR_GLOBALS", None)
    # Triton 3.9's default (fp fusion on), stated so that it does not warn in every worker
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    torch.set_num_threads(1)


# ---------------------------------------------------------------------------------------------
# Many compilations


def summary_line(case: Case, record: dict) -> str:
    if not record["ok"]:
        return f"{case.label():<78} FAIL {record['error']}"
    return (f"{case.label():<78} ok  reg {record['registers']:>3}  spill "
            f"{record['spill_bytes']:>5}  smem {record['shared_bytes']:>6}")  # fmt: skip


def compile_cases(cases: list[Case], jobs: int = 1, out=sys.stdout) -> list[dict]:
    """Compile every case in `jobs` worker processes, printing one line each as it finishes
    (with a running count and the time so far)."""
    records = []
    start = time.perf_counter()
    context = get_context("spawn")
    with ProcessPoolExecutor(jobs, mp_context=context, initializer=_worker_setup) as pool:
        for i, (case, record) in enumerate(
            zip(cases, pool.map(compile_case, cases), strict=True), 1
        ):
            records.append(record)
            elapsed = time.perf_counter() - start
            print(f"[{i:>4}/{len(cases)} {elapsed:6.0f}s] {summary_line(case, record)}",
                  file=out, flush=True)  # fmt: skip
    return records


def problems(records: list[dict], spill_dtypes=("float16", "bfloat16")) -> list[str]:
    """Failures, and spills in the given dtypes: what the tests and the exit status check."""
    found = []
    for r in records:
        where = f"{r['kernel']} sm_{r['arch']} {r['dtype']} D={r['head_dim']} {r['config']}"
        if not r["ok"]:
            found.append(f"{where}: {r['error']}")
        elif r["dtype"] in spill_dtypes and r["spill_bytes"]:
            found.append(f"{where}: spills {r['spill_bytes']} B per thread")
    return found


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--arch",
        default="80,90",
        help="compute capabilities to compile for, comma-separated (default 80,90)",
    )
    parser.add_argument("--json", type=Path, default=None, help="write the records here")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a representative subset (20 compilations) instead of all",
    )
    parser.add_argument("--jobs", type=int, default=1, help="worker processes (default 1)")
    parser.add_argument("--dtypes", default=",".join(DTYPES),
                        help="dtypes of the full matrix, comma-separated")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from ..cli_types import UsageError

    try:
        archs = tuple(int(a) for a in args.arch.split(","))
    except ValueError:
        raise UsageError("--arch", f"expected numbers like 80,90, got {args.arch!r}") from None
    dtypes = tuple(args.dtypes.split(","))
    if not set(dtypes) <= set(DTYPES):
        raise UsageError("--dtypes", f"choose from {','.join(DTYPES)}")
    cases = quick_matrix(archs) if args.quick else full_matrix(archs, dtypes)
    print(f"compiling {len(cases)} configurations for sm_{', sm_'.join(map(str, archs))}",
          flush=True)  # fmt: skip
    records = compile_cases(cases, max(1, args.jobs))
    if args.json is not None:
        args.json.write_text(json.dumps(records, indent=1) + "\n")
    found = problems(records)
    wide = [r for r in records if r["ok"] and r["dtype"] not in ("float16", "bfloat16")
            and (r["spill_bytes"] or 0) >= 1024]  # fmt: skip
    print(f"{sum(r['ok'] for r in records)}/{len(records)} compiled; "
          f"{len(found)} problem(s) (failures, fp16/bf16 spills); "
          f"{len(wide)} fp32/fp64 case(s) with >= 1 KB of stack")  # fmt: skip
    for line in found:
        print(f"  {line}")
    return 1 if found else 0


__all__ = ["Case", "compile_case", "compile_cases", "full_matrix", "problems", "quick_matrix"]
