"""`urpe bench compile`: compile the Triton kernels for real GPUs ahead of time, without one.

Triton's CPU interpreter accepts what the GPU compiler refuses and knows nothing of registers or
shared memory, so the interpreter tests cannot show that the kernels build, or build well. Triton
compiles for a CUDA target on any machine, down to the cubin with the `ptxas` it bundles; the
bundled `cuobjdump --dump-resource-usage` then reports registers and stack per thread (a stack
frame is where ptxas spills registers). One line per configuration:

    backward_kv  sm_80 bfloat16 D=64  32x32 w4 s2 relation/dense exp G=1 Lq=1024 Lk=1 pad
        ok  reg 198  spill     0  smem  20480

What is compiled is what the public call launches. The features of a call that change the
program (`launch_factors`: bias and gate kinds, normalisation, causal, padding, a bool mask,
dropout, the gradients wanted, TF32, and the integer arguments Triton specialises: lengths of 1,
of a multiple of 16 or neither, one or several query heads per kv head) are read off the launch
code, and their product (thousands of programs per configuration) is covered by a covering
array: rows in which every pair of the features' values occurs (`covering`, about 20 rows; the
launches that once spilled are rows of their own). Every row is compiled at every tile
configuration the autotuner may pick for it (`launch.CONFIGS`), with the register cap the
launches state (`launch.MAX_REGISTERS`). Each case builds `ForwardArgs` on meta tensors, asks
`urpe.kernels.triton.ops` for its launches and specialises them as Triton's launcher does (a
stride or size of 1 becomes a constant, pointers and multiples of 16 are aligned). Compilation
runs in worker processes without TRITON_INTERPRET (a process that has it has only interpreted
kernels).
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
from contextlib import contextmanager
from dataclasses import dataclass, fields
from multiprocessing import get_context
from pathlib import Path

import torch

from .compile_options import DTYPES, STRENGTH

ARCHS = (80, 90)
HEAD_DIMS = (64, 128)
KERNELS = ("forward", "backward_kv", "backward_q")
# Shared memory a block may use (opt-in maximum), bytes.
SHARED_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}
# What the launches are specialised on where a case does not say (Lq = Lk = length).
SHAPE = dict(batch=2, kv_heads=2, length=1024)
BOOLS = (False, True)
# Triton's launcher specialises an integer argument as 1 (a constant), a multiple of 16 or
# neither: one value of each class, for the lengths and for the query heads per kv head.
LENGTHS = (1, 1000, 1024)
GROUPS = (1, 2, 16)


@dataclass(frozen=True)
class Case:
    """One compilation: a kernel, a target, a dtype, a head dim, a tile configuration
    (BLOCK_M, BLOCK_N, num_warps, num_stages) and the call's features (`launch_factors`)."""

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
    documents: bool = True  # document_ids (packed sequences)
    groups: int = 1  # query heads per key/value head
    lq: int | None = None  # None: SHAPE["length"]
    lk: int | None = None
    bias_grad: bool = True  # the dQ kernel: which term gradients are wanted,
    gate_grad: bool = True
    deterministic: bool = False  # and whether table gradients go dense (no atomics)
    tf32: bool = False  # float32 products in TF32 (torch.backends.cuda.matmul.allow_tf32)

    def label(self) -> str:
        m, n, w, s = self.blocks
        if self.kernel == "dropout_mask":
            return f"{self.kernel:<12} sm_{self.arch} {m}x{n} w{w} s{s}"
        flags = [f for f, on in (("causal", self.causal), ("dropout", self.dropout),
                                 ("pad", self.padding), ("mask", self.mask),
                                 ("docs", self.documents)) if on]  # fmt: skip
        if self.kernel == "backward_kv" and self.bias == "decay":
            flags += ["dB"] if self.bias_grad else []
        if self.kernel == "backward_q":
            flags += [f for f, on in (("dB", self.bias_grad), ("dC", self.gate_grad),
                                      ("det", self.deterministic)) if on]  # fmt: skip
        flags += ["tf32"] if self.tf32 else []
        return (f"{self.kernel:<12} sm_{self.arch} {self.dtype:<8} D={self.head_dim:<3} "
                f"{m}x{n} w{w} s{s} {self.bias}/{self.gate} {self.normalization} "
                f"G={self.groups} Lq={self.lengths[0]} Lk={self.lengths[1]} "
                f"{' '.join(flags)}")  # fmt: skip

    @property
    def lengths(self) -> tuple[int, int]:
        return (self.lq or SHAPE["length"], self.lk or SHAPE["length"])


FEATURES_FROM = [f.name for f in fields(Case)].index("bias")  # the fields that describe the call


# ---------------------------------------------------------------------------------------------
# Which cases: derived from the launch code, not listed by hand


def launch_factors(kernel: str, dtype: str) -> dict[str, tuple]:
    """Every feature of a public call that changes the program a kernel compiles to, with every
    value it can take there: the constexpr flags `ops` derives from a call (bias and gate kinds,
    a Decay being a bias only, normalisation, causal, padding, a bool mask, document ids,
    dropout; for the dQ kernel the term gradients wanted and the deterministic mode, for the
    dK/dV kernel whether a Decay's gradient is wanted; for float32 TF32 products) and the
    integer arguments Triton specialises (lengths, query heads per kv head).
    `test_triton_compiles` checks that every constexpr argument of the kernels is one of these or
    a tile or dtype constant."""
    from ..kernels.triton import ops

    factors = dict(bias=tuple(ops.KIND_CODES), gate=ops.GATE_KINDS,
                   normalization=tuple(ops.NORMALIZATION_CODES), causal=BOOLS, padding=BOOLS,
                   mask=BOOLS, documents=BOOLS, dropout=BOOLS, groups=GROUPS, lq=LENGTHS,
                   lk=LENGTHS)  # fmt: skip
    if kernel == "backward_q":
        factors.update(bias_grad=BOOLS, gate_grad=BOOLS, deterministic=BOOLS)
    if kernel == "backward_kv":
        factors.update(bias_grad=BOOLS)
    if dtype == "float32":
        factors["tf32"] = BOOLS
    return factors


def kept_blocks(kernel: str, head_dim: int, dtype: str, features: dict | None = None) -> tuple:
    """The autotuner's configurations for this kernel, head dim, dtype and call features (some
    variants have their own: `launch.configs_for`)."""
    from ..kernels.triton.launch import configs_for, dtype_family

    if kernel == "dropout_mask":
        return ((16, 16, 4, 1),)
    features = features or {}
    decay_grad = features.get("bias", Case.bias) == "decay" and features.get("bias_grad", True)
    documents = features.get("documents", Case.documents)
    return configs_for(kernel, head_dim, dtype_family(dtype), decay_grad, documents)


def feature_rows(kernel: str, dtype: str, strength: int = STRENGTH) -> list[dict]:
    """Rows of features covering every `strength` of them (see `covering`), then the launches
    `ONCE_SPILLED` names for this kernel."""
    from .covering import covering_rows

    if kernel == "dropout_mask":
        return [{}]
    names = launch_factors(kernel, dtype)
    rows = covering_rows(names, strength)
    return rows + [f for k, f in ONCE_SPILLED if k == kernel and f not in rows]


# Launches that the hand-written matrix missed and that spilled on sm_80 in bf16 at 32 x 32,
# 4 warps, while ptxas chose its own register budget (issue 29; 32, 16 and 8 B at 168, 168 and
# 128 registers): rows of their own, whatever the covering array holds.
ONCE_SPILLED = (
    ("backward_kv", dict(bias="dense", gate="relation", normalization="l2", causal=False,
                         padding=False, mask=False, documents=False, dropout=False, groups=2,
                         lq=1024, lk=1024)),
    ("backward_kv", dict(bias="relation", gate="none", normalization="l2", causal=False,
                         padding=False, mask=True, documents=False, dropout=False, groups=1,
                         lq=1000, lk=1024)),
    ("backward_kv", dict(bias="relation", gate="dense", normalization="exp", causal=False,
                         padding=True, mask=False, documents=False, dropout=False, groups=1,
                         lq=1024, lk=1)),
)  # fmt: skip


def full_matrix(archs=ARCHS, dtypes=DTYPES, strength: int = STRENGTH) -> list[Case]:
    """Every kernel x target x dtype x D x autotuner configuration x feature row."""
    cases = []
    for kernel in (*KERNELS, "dropout_mask"):
        for arch, dtype, d in itertools.product(archs, dtypes, HEAD_DIMS):
            if kernel == "dropout_mask" and (dtype, d) != (DTYPES[0], HEAD_DIMS[0]):
                continue
            for features in feature_rows(kernel, dtype, strength):
                for blocks in kept_blocks(kernel, d, dtype, features):
                    cases.append(Case(kernel, arch, dtype, d, blocks, **features))
    return list(dict.fromkeys(cases))


def quick_matrix(archs=ARCHS) -> list[Case]:
    """A representative subset (about 30 compilations, 4 minutes on one core): the heaviest
    variants (Toeplitz bias and gate, causal, padding, bool mask, document ids, dropout; and the
    same with a Decay bias at D=128, where registers are scarcest) at the autotuner's first
    configuration per kernel x target x D in bf16 (fp16 compiles to about the same registers),
    one fp32 case per kernel, the dropout-mask kernel and, on sm_80, the launches that once
    spilled."""
    cases = []
    for kernel, arch in itertools.product(KERNELS, archs):
        for dtype, d in (("bfloat16", 64), ("bfloat16", 128)):
            cases.append(Case(kernel, arch, dtype, d, kept_blocks(kernel, d, dtype)[0]))
            if d == 128:
                decay = kept_blocks(kernel, d, dtype, dict(bias="decay"))[0]
                cases.append(Case(kernel, arch, dtype, d, decay, bias="decay"))
        cases.append(Case(kernel, arch, "float32", 64, kept_blocks(kernel, 64, "float32")[0]))
        cases.append(Case("dropout_mask", arch, "float16", 64, (16, 16, 4, 1)))
    for kernel, features in ONCE_SPILLED:
        for blocks in kept_blocks(kernel, 64, "bfloat16"):
            cases.append(Case(kernel, min(archs), "bfloat16", 64, blocks, **features))
    return list(dict.fromkeys(cases))


# ---------------------------------------------------------------------------------------------
# One compilation (runs in a worker process)


def _term(kind: str, b: int, h: int, lq: int, lk: int, dtype) -> tuple:
    """(tensor, index) of a bias or gate on the meta device."""
    meta = dict(device="meta", dtype=dtype)
    if kind == "toeplitz":
        return torch.empty(h, 2 * max(lq, lk) - 1, **meta), None
    if kind == "relation":
        index = torch.empty(b, lq, lk, device="meta", dtype=torch.int64)
        return torch.empty(h, 64, **meta), index
    if kind == "dense":
        return torch.empty(b, h, lq, lk, **meta), None
    if kind == "decay":  # log_forget
        return torch.empty(b, h, lk, **meta), None
    return None, None


@contextmanager
def _torch_flags(case: Case):
    """The global switches a launch reads (deterministic mode, TF32), as the case has them."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.use_deterministic_algorithms(case.deterministic)
    torch.backends.cuda.matmul.allow_tf32 = case.tf32
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(deterministic)
        torch.backends.cuda.matmul.allow_tf32 = tf32


def launch_of(case: Case):
    """The library's own `Launch` for this case (meta tensors, the sizes from the case and
    SHAPE)."""
    from ..kernels.layout import BackwardArgs, ForwardArgs
    from ..kernels.triton import ops

    b, hkv = SHAPE["batch"], SHAPE["kv_heads"]
    h, (lq, lk) = hkv * case.groups, case.lengths
    dtype = getattr(torch, case.dtype)
    q = torch.empty(b, h, lq, case.head_dim, device="meta", dtype=dtype)
    k, v = (torch.empty(b, hkv, lk, case.head_dim, device="meta", dtype=dtype) for _ in "kv")
    bias, bias_index = _term(case.bias, b, h, lq, lk, dtype)
    gate, gate_index = _term(case.gate, b, h, lq, lk, dtype)
    mask = torch.empty(b, 1, lq, lk, device="meta", dtype=torch.bool) if case.mask else None
    padding = torch.empty(b, lk, device="meta", dtype=torch.bool) if case.padding else None
    ids = torch.empty(b, lk, device="meta", dtype=torch.int64) if case.documents else None
    seed = torch.tensor(2**61 + 12345)  # drawn seeds are int64
    args = ForwardArgs(
        q, k, v, bias, bias_index, gate, gate_index, mask, padding, ids, seed, case.bias,
        case.gate, case.causal, case.normalization, case.head_dim**-0.5,
        0.1 if case.dropout else 0.0, 0, 0,
    )  # fmt: skip
    with _torch_flags(case):
        if case.kernel == "forward":
            return ops.forward_launch(args)[0]
        grads = BackwardArgs(q, q, q.new_empty(b, h, lq), args, case.bias_grad, case.gate_grad,
                             False)  # fmt: skip
        launches = ops.backward_launches(grads)
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
        seed = torch.empty(1, device="meta", dtype=torch.int64)  # read on the device
        fn, values = K.dropout_mask_kernel, (keep, seed, 0, 1024, 1024, 8, 0.1)
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

    from ..kernels.triton.launch import MAX_REGISTERS

    tiles = dict(zip(("block_m", "block_n", "num_warps", "num_stages"), case.blocks, strict=True))
    record = dict(kernel=case.kernel, arch=case.arch, dtype=case.dtype, head_dim=case.head_dim,
                  config=dict(tiles, **{f.name: getattr(case, f.name)
                                        for f in fields(Case)[FEATURES_FROM:]}),
                  ok=False, error=None, registers=None, spill_bytes=None, shared_bytes=None,
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


def run(args: argparse.Namespace) -> int:
    from ..cli_types import UsageError

    try:
        archs = tuple(int(a) for a in args.arch.split(","))
    except ValueError:
        raise UsageError("--arch", f"expected numbers like 80,90, got {args.arch!r}") from None
    dtypes = tuple(args.dtypes.split(","))
    if not set(dtypes) <= set(DTYPES):
        raise UsageError("--dtypes", f"choose from {','.join(DTYPES)}")
    if args.strength < 1:
        raise UsageError("--strength", f"expected 1 or more, got {args.strength}")
    cases = quick_matrix(archs) if args.quick else full_matrix(archs, dtypes, args.strength)
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


__all__ = ["Case", "compile_case", "compile_cases", "full_matrix", "launch_factors", "problems",
           "quick_matrix"]  # fmt: skip
