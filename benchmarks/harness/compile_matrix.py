"""The Triton kernels compiled for real GPUs ahead of time, without one
(benchmarks/compile_kernels.py), from what the public call launches.

Triton's CPU interpreter accepts what the GPU compiler refuses and knows nothing of registers or
shared memory, so the interpreter tests cannot show that the kernels build, or build well. Triton
compiles for a CUDA target on any machine, down to the cubin with the `ptxas` it bundles; the
bundled `cuobjdump --dump-resource-usage` then reports registers and stack per thread (a stack
frame is where ptxas spills registers). One line per compiled program:

    backward_kv  sm_80 bfloat16 D=64  32x32 w4 s2 bfloat16 D=64 bias=dense gate=relation ...
        ok  reg 198  spill     0  smem  20480

What is compiled is what `urpe.attention(..., backend="triton")` launches (`launches`): each
call of the matrix is made for real, forward and backward, with the kernels replaced by
recorders, and each distinct program it launches (kernel, constexpr arguments, and Triton's
specialisation of every other argument) is compiled at every tile configuration the autotuner
may pick for it (`launch.configs_for`), with the register cap the launches state
(`launch.MAX_REGISTERS`). The calls are a covering array (`covering`) over the features a user
chooses (`factors`): rows in which every pair of the features' values occurs; calls that a
matrix of pairs may miss and that once spilled are rows of their own (`NAMED`). Compilation runs
in worker processes without TRITON_INTERPRET (a process that has it has only interpreted
kernels); recording in one with it.
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
from dataclasses import asdict, dataclass
from multiprocessing import get_context
from pathlib import Path

import torch

from urpe.cli_types import UsageError

from .covering import covering_rows
from .launches import DROPOUT_MASK, Call, Launch, recorded

DTYPES = ("float16", "bfloat16", "float32", "float64")
STRENGTH = 2  # every pair of features' values is compiled together (see `covering`)
ARCHS = (80, 90)
HEAD_DIMS = (64, 128)  # the autotuner's two head-dim buckets
KERNELS = ("forward", "backward_kv", "backward_q")
# Shared memory a block may use (opt-in maximum), bytes.
SHARED_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}
BOOLS = (False, True)
# Triton's launcher specialises an integer argument as 1 (a constant), a multiple of 16 or
# neither: one value of each class, for the lengths and for the query heads per kv head.
LENGTHS = (1, 1000, 1024)
GROUPS = (1, 4, 16)
# The dropout-mask kernel's launch: 16 x 16 tiles at Triton's default warps and stages.
MASK_BLOCKS = (16, 16, 4, 3)


def factors(dtype: str, head_dim: int) -> dict[str, tuple]:
    """Every feature of a public call (`launches.Call`) that may change what it launches, with a
    value of every kind it takes: the terms and the normalisation (each sets a constexpr), the
    masks, documents and dropout, grouped heads and lengths (integers Triton specialises), the
    terms broadcast over batch and heads (strides 0), a Toeplitz table clamped at a distance,
    q, k, v as views of (B, L, H, D), a head dim that is not a multiple of 16 (strides), whether
    the terms need gradients, torch's deterministic mode (table gradients written densely) and,
    in float32, TF32 products. `test_triton_compiles` checks that the calls vary every
    constexpr of every launch."""
    found = dict(
        bias=("none", "toeplitz", "relation", "dense", "decay"),
        gate=("none", "toeplitz", "relation", "dense"),
        normalization=("softmax", "exp", "l2", "relu2"),
        causal=BOOLS, padding=BOOLS, mask=("none", "bool", "float"), documents=BOOLS,
        dropout=BOOLS, groups=GROUPS, kv_heads=(1, 2), lq=LENGTHS, lk=LENGTHS, shared=BOOLS,
        table=("all", "clamped"), layout=("bhld", "blhd"), term_grads=BOOLS,
        deterministic=BOOLS, head_dim=(head_dim, head_dim - 24),
    )  # fmt: skip
    if dtype == "float32":
        found["tf32"] = BOOLS
    return found


# Calls a matrix of pairs may miss, each a row of its own: those a report or an earlier run
# found spilling on sm_80 in half precision (issue 29: before the register cap was stated;
# issue 39: the dK/dV kernel at 32 x 32, 4 warps, 2 stages, in bfloat16 and float16).
NAMED = {
    "Toeplitz B and C, causal": dict(bias="toeplitz", gate="toeplitz", causal=True),
    "GQA x4, dense B, Relation C, l2": dict(
        bias="dense", gate="relation", normalization="l2", groups=4
    ),
    "GQA x4, dense B, Relation C, l2, padding, bool mask, dropout, D=40": dict(
        bias="dense", gate="relation", normalization="l2", groups=4, padding=True, mask="bool",
        dropout=True, head_dim=40, lq=1000, lk=1000, layout="blhd",
    ),
    "Toeplitz B and C, causal, bool mask, documents, dropout, Lq=Lk=1000": dict(
        bias="toeplitz", gate="toeplitz", causal=True, mask="bool", documents=True,
        dropout=True, lq=1000, lk=1000,
    ),
    "dense B, Relation C, l2, G=2 (issue 29)": dict(
        bias="dense", gate="relation", normalization="l2", groups=2
    ),
    "Relation B, l2, bool mask, Lq=1000 (issue 29)": dict(
        bias="relation", normalization="l2", mask="bool", lq=1000
    ),
    "Relation B, dense C, exp, padding, Lk=1 (issue 29)": dict(
        bias="relation", gate="dense", normalization="exp", padding=True, lk=1
    ),
}  # fmt: skip
HALF = ("float16", "bfloat16")


def calls(dtypes=DTYPES, head_dims=HEAD_DIMS, strength: int = STRENGTH) -> list[Call]:
    """The covering array's calls for every dtype and head-dim bucket, then the NAMED calls in
    half precision at D <= 64."""
    found = []
    for dtype, d in itertools.product(dtypes, head_dims):
        found += [Call(dtype=dtype, **row) for row in covering_rows(factors(dtype, d), strength)]
    for dtype in (t for t in dtypes if t in HALF):
        found += [Call(dtype=dtype, **features) for features in NAMED.values()]
    return list(dict.fromkeys(found))


@dataclass(frozen=True)
class Case:
    """One compilation: a launch, a target, a tile configuration (BLOCK_M, BLOCK_N, num_warps,
    num_stages), and the first call that launched it (for the report)."""

    launch: Launch
    arch: int
    blocks: tuple[int, int, int, int]
    call: Call

    @property
    def kernel(self) -> str:
        return self.launch.kernel

    def label(self) -> str:
        m, n, w, s = self.blocks
        return f"{self.kernel:<12} sm_{self.arch} {m}x{n} w{w} s{s} {self.call.label()}"


def tile_configs(launch: Launch) -> tuple[tuple[int, int, int, int], ...]:
    """The configurations the autotuner keeps for this launch: those of its kernel, head dim,
    dtype family and variant (a Decay's gradient, documents), as the launcher prunes them."""
    from urpe.kernels.triton import kernels as K
    from urpe.kernels.triton.launch import configs_for, dtype_family

    if launch.kernel == "dropout_mask":
        return (MASK_BLOCKS,)
    meta = launch.constants
    block_d = max(meta["BLOCK_D"], meta["BLOCK_DV"])
    family = dtype_family(launch.args[0][1])  # q's dtype
    decay_grad = meta.get("B_GRAD") == K.DECAY.value
    return configs_for(launch.kernel, block_d, family, decay_grad, bool(meta["DOCS"]))


def cases(found: dict[Call, list[Launch] | str], archs=ARCHS, first_only=False) -> list[Case]:
    """Every distinct program the calls launch, at every (or the first) configuration the
    autotuner may pick for it, for every target."""
    programs: dict[tuple, tuple[Launch, Call]] = {}
    for call, launches in found.items():
        if isinstance(launches, str):
            continue  # refused by the public call: launches nothing
        for launch in launches:
            programs.setdefault(launch.program(), (launch, call))
    out = []
    for launch, call in programs.values():
        configs = tile_configs(launch)
        for arch, blocks in itertools.product(archs, configs[:1] if first_only else configs):
            out.append(Case(launch, arch, blocks, call))
    return out


def full_matrix(archs=ARCHS, dtypes=DTYPES, strength: int = STRENGTH) -> list[Case]:
    """Every program the matrix's calls launch (and the dropout mask's), at every configuration,
    for every target."""
    return cases(recorded(calls(dtypes, HEAD_DIMS, strength)), archs)


# The quick subset: the heaviest call (every term, mask and flag at once) in bfloat16 at both
# head dims, with a Decay bias at D=128 (where registers are scarcest), one float32 call, each
# at its first configuration; the NAMED calls' dK/dV launches in bfloat16 on sm_80, where they
# spilled, at every configuration; and the dropout-mask kernel.
HEAVIEST = dict(bias="toeplitz", gate="toeplitz", causal=True, padding=True, mask="bool",
                documents=True, dropout=True)  # fmt: skip


def quick_matrix(archs=ARCHS) -> list[Case]:
    """A representative subset (about 40 compilations, a few minutes on one core)."""
    heavy = [
        Call(dtype="bfloat16", head_dim=64, **HEAVIEST),
        Call(dtype="bfloat16", head_dim=128, **HEAVIEST),
        Call(dtype="bfloat16", head_dim=128, **dict(HEAVIEST, bias="decay")),
        Call(dtype="float32", head_dim=64, **HEAVIEST),
    ]
    named = [Call(dtype="bfloat16", **features) for features in NAMED.values()]
    found = recorded(heavy + named)
    chosen = cases({c: found[c] for c in heavy}, archs, first_only=True)
    chosen += cases({DROPOUT_MASK: found[DROPOUT_MASK]}, archs)
    sm80 = cases({c: found[c] for c in named}, (min(archs),))
    return list(dict.fromkeys(chosen + [c for c in sm80 if c.kernel == "backward_kv"]))


# ---------------------------------------------------------------------------------------------
# One compilation (runs in a worker process)


def _argument(described: tuple):
    """A stand-in for one recorded argument that Triton specialises as it did the original."""
    if described[0] == "tensor":
        dtype = getattr(torch, described[1])
        base = torch.empty(2, dtype=dtype)
        return base if described[2] else base[1:]  # one element in: not 16-byte aligned
    if described[0] == "int":
        return described[1]
    return 0.5


def _source(case: Case):
    """(jit function, signature, constexprs, attrs) as Triton's launcher would build them."""
    import triton.language as tl
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend

    from urpe.kernels.triton import kernels as K
    from urpe.kernels.triton.launch import KERNELS, tile_meta

    m, n = case.blocks[:2]
    meta = case.launch.constants
    if "ACC" in meta:
        meta["ACC"] = getattr(tl, meta["ACC"])
    if case.kernel == "dropout_mask":
        fn = K.dropout_mask_kernel
        meta.update(BLOCK_M=m, BLOCK_N=n)
    else:
        fn = KERNELS[case.kernel]
        meta.update(tile_meta(case.kernel, m, n))
    signature, constexprs, attrs = {}, dict(meta), {}
    runtime = [name for name in fn.arg_names if name not in meta]
    assert len(runtime) == len(case.launch.args), (case.kernel, runtime, case.launch.args)
    for name, described in zip(runtime, case.launch.args, strict=True):
        value = _argument(described)
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

    from urpe.kernels.triton.launch import MAX_REGISTERS

    tiles = dict(zip(("block_m", "block_n", "num_warps", "num_stages"), case.blocks, strict=True))
    record = dict(kernel=case.kernel, arch=case.arch, dtype=case.call.dtype,
                  head_dim=case.call.head_dim, config=dict(tiles, **asdict(case.call)), ok=False,
                  error=None, registers=None, spill_bytes=None, shared_bytes=None,
                  seconds=None)  # fmt: skip
    start = time.perf_counter()
    try:
        fn, signature, constexprs, attrs = _source(case)
        source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
        options = dict(num_warps=case.blocks[2], num_stages=case.blocks[3])
        if case.kernel != "dropout_mask":  # the register cap the launches state
            options["maxnreg"] = MAX_REGISTERS
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
        return f"{case.label()}\n    FAIL {record['error']}"
    return (f"{case.label()}\n    ok  reg {record['registers']:>3}  spill "
            f"{record['spill_bytes']:>5}  smem {record['shared_bytes']:>6}")  # fmt: skip


def compile_cases(cases: list[Case], jobs: int = 1, out=sys.stdout) -> list[dict]:
    """Compile every case in `jobs` worker processes, printing one entry each as it finishes
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


def problems(records: list[dict], spill_dtypes=HALF) -> list[str]:
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
    add = parser.add_argument
    add("--arch", default="80,90", help="compute capabilities to compile for, comma-separated")
    add("--json", type=Path, default=None, help="write the records here")
    add("--quick", action="store_true", help="a representative subset instead of all")
    add(
        "--strength",
        type=int,
        default=STRENGTH,
        help="make calls holding every combination of this many features' values (2: every "
        "pair; 3 compiles several times as many programs)",
    )
    add("--jobs", type=int, default=1, help="worker processes")
    add("--dtypes", default=",".join(DTYPES), help="dtypes of the full matrix, comma-separated")


def run(args: argparse.Namespace) -> int:
    try:
        archs = tuple(int(a) for a in args.arch.split(","))
    except ValueError:
        raise UsageError("--arch", f"expected numbers like 80,90, got {args.arch!r}") from None
    dtypes = tuple(args.dtypes.split(","))
    if not set(dtypes) <= set(DTYPES):
        raise UsageError("--dtypes", f"choose from {','.join(DTYPES)}")
    if args.strength < 1:
        raise UsageError("--strength", f"expected 1 or more, got {args.strength}")
    print("recording the launches of the public calls (Triton's interpreter)", flush=True)
    chosen = quick_matrix(archs) if args.quick else full_matrix(archs, dtypes, args.strength)
    print(f"compiling {len(chosen)} programs for sm_{', sm_'.join(map(str, archs))}", flush=True)
    records = compile_cases(chosen, max(1, args.jobs))
    if args.json is not None:
        args.json.write_text(json.dumps(records, indent=1) + "\n")
    found = problems(records)
    wide = [r for r in records if r["ok"] and r["dtype"] not in HALF
            and (r["spill_bytes"] or 0) >= 1024]  # fmt: skip
    print(f"{sum(r['ok'] for r in records)}/{len(records)} compiled; "
          f"{len(found)} problem(s) (failures, fp16/bf16 spills); "
          f"{len(wide)} fp32/fp64 case(s) with >= 1 KB of stack")  # fmt: skip
    for line in found:
        print(f"  {line}")
    return 1 if found else 0


__all__ = ["Case", "calls", "compile_case", "compile_cases", "factors", "full_matrix",
           "problems", "quick_matrix"]  # fmt: skip
