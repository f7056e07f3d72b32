"""What the public call launches: `urpe.attention(..., backend="triton")` run on CPU tensors
under Triton's interpreter with the kernels replaced by recorders, so that every launch is
recorded as the kernel receives it and none runs.

A `Call` is one public call described by the features a user chooses (the terms and how they
broadcast, the normalisation, masks, documents, dropout, grouped heads, lengths, head dim,
layout, which gradients are wanted, torch's deterministic and TF32 switches). `record(calls)`
makes each call for real (forward and backward) and returns its launches: the kernel, its
constexpr arguments and, for every other argument, what Triton's launcher specialises on (a
tensor's dtype and 16-byte alignment; an integer equal to 1, divisible by 16 or neither). The
compile matrix (`compile_matrix`) compiles exactly these.

Two things differ between the interpreter and a GPU, and are set as a GPU sets them: UPCAST
(bfloat16 computed in float32, for numpy) is off, and a float32 call under
`torch.backends.cuda.matmul.allow_tf32` multiplies in TF32 (the CPU never does). The tile sizes
the interpreter runs (16 x 16) are dropped: the compile matrix compiles each launch at every
configuration the autotuner may pick for it.

Recording needs the interpreter on (TRITON_INTERPRET=1 before triton is imported): `record`
runs in a worker process that sets it (`recorded`).
"""

from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, fields
from multiprocessing import get_context

import torch

TILES = ("BLOCK_M", "BLOCK_N", "WIDTH")  # set per configuration, not by the call
MAX_DISTANCE = 128  # a Toeplitz table that clamps at this offset ("table" = "clamped")
RELATIONS = 33  # entries of a Relation table


@dataclass(frozen=True)
class Call:
    """One public call, by the features that change what it launches."""

    dtype: str = "bfloat16"
    head_dim: int = 64
    bias: str = "none"  # none, toeplitz, relation, dense, decay
    gate: str = "none"  # none, toeplitz, relation, dense
    normalization: str = "softmax"
    causal: bool = False
    padding: bool = False  # key_padding_mask
    mask: str = "none"  # attn_mask: none, bool, float (added to the bias)
    documents: bool = False  # document_ids (packed sequences)
    dropout: bool = False
    groups: int = 1  # query heads per key/value head
    kv_heads: int = 2
    lq: int = 1024
    lk: int = 1024
    shared: bool = False  # terms and masks broadcast over batch and heads
    table: str = "all"  # a Toeplitz table for every offset, or "clamped" at MAX_DISTANCE
    layout: str = "bhld"  # q, k, v contiguous, or "blhd": views of (B, L, H, D) tensors
    term_grads: bool = True  # whether bias and gate require grad
    deterministic: bool = False  # torch.use_deterministic_algorithms
    tf32: bool = False  # torch.backends.cuda.matmul.allow_tf32 (float32 only)

    def label(self) -> str:
        default = Call()
        changed = [
            f"{f.name}={getattr(self, f.name)}"
            for f in fields(self)
            if f.name not in ("dtype", "head_dim")
            and getattr(self, f.name) != getattr(default, f.name)
        ]
        return f"{self.dtype} D={self.head_dim} " + (" ".join(changed) or "plain")


@dataclass(frozen=True)
class Launch:
    """One kernel launch as the compiler sees it: the kernel ("forward", "backward_kv",
    "backward_q" or "dropout_mask"), its constexpr arguments (without the tiles), and for each
    other argument ("tensor", dtype, 16-byte aligned), ("int", value) or ("float",)."""

    kernel: str
    meta: tuple[tuple[str, object], ...]
    args: tuple[tuple, ...]

    @property
    def constants(self) -> dict:
        return dict(self.meta)

    def program(self) -> tuple:
        """What the compiled program depends on: the launch with each integer replaced by its
        class (1, divisible by 16, neither), as Triton's launcher specialises it."""
        classes = tuple(
            ("int", 1 if a[1] == 1 else 16 if a[1] % 16 == 0 else 17) if a[0] == "int" else a
            for a in self.args
        )
        return (self.kernel, self.meta, classes)


# ---------------------------------------------------------------------------------------------
# Making a call


def _inputs(call: Call):
    """q, k, v and the keyword arguments of `urpe.attention` for this call (CPU tensors)."""
    import urpe

    dtype = getattr(torch, call.dtype)
    b, hkv = 2, call.kv_heads
    h, lq, lk, d = hkv * call.groups, call.lq, call.lk, call.head_dim

    def qkv(heads: int, length: int):
        if call.layout == "blhd":  # (B, L, H, D) as a model's projection writes it
            return torch.randn(b, length, heads, d, dtype=dtype).transpose(1, 2).requires_grad_()
        return torch.randn(b, heads, length, d, dtype=dtype, requires_grad=True)

    q, k, v = qkv(h, lq), qkv(hkv, lk), qkv(hkv, lk)
    lead = (1, 1) if call.shared else (b, h)
    table_heads = 1 if call.shared else h
    width = MAX_DISTANCE if call.table == "clamped" else max(lq, lk) - 1
    tables = torch.float64 if dtype == torch.float64 else torch.float32  # a model's parameters

    def term(kind: str):
        grad = call.term_grads
        if kind == "toeplitz":
            return urpe.Toeplitz(
                torch.randn(table_heads, 2 * width + 1, dtype=tables).requires_grad_(grad)
            )
        if kind == "relation":
            index = torch.randint(0, RELATIONS, (1 if call.shared else b, lq, lk))
            table = torch.randn(table_heads, RELATIONS, dtype=tables).requires_grad_(grad)
            return urpe.Relation(table, index)
        if kind == "dense":
            return torch.randn(*lead, lq, lk, dtype=dtype, requires_grad=grad)
        if kind == "decay":
            forget = torch.rand(*lead, lk, dtype=tables).clamp_min(0.5).log()
            return urpe.Decay(forget.requires_grad_(grad))
        return None

    kwargs = dict(bias=term(call.bias), gate=term(call.gate), normalization=call.normalization)
    kwargs.update(is_causal=call.causal, enable_gqa=call.groups > 1, backend="triton")
    if call.padding:
        kwargs["key_padding_mask"] = torch.arange(lk).expand(b, lk) >= lk - 3  # 3 padded keys
    if call.mask != "none":
        keep = torch.rand(*lead, lq, lk) < 0.9
        keep[..., 0] = True  # every query sees a key
        kwargs["attn_mask"] = (
            keep if call.mask == "bool" else torch.zeros(keep.shape).masked_fill(~keep, -1e4)
        )
    if call.documents:
        kwargs["document_ids"] = (torch.arange(lk) // max(1, lk // 3)).expand(b, lk)
    if call.dropout:
        kwargs["dropout_p"] = 0.1
    return (q, k, v), kwargs


class _Recorder:
    """Stands in for a Triton kernel: `kernel[grid](*args, **constants)` records the launch and
    writes zeros into the buffers the launch would write (so that what follows the forward,
    such as the check that `exp` did not overflow, reads numbers)."""

    def __init__(self, name: str, arg_names: list[str], inputs: set[int], out: list):
        self.name, self.arg_names, self.inputs, self.out = name, arg_names, inputs, out

    def __getitem__(self, grid):
        return self

    def __call__(self, *args, **constants):
        runtime = [n for n in self.arg_names if n not in constants]
        assert len(runtime) == len(args), (self.name, runtime, len(args))
        described = []
        for value in args:
            if isinstance(value, torch.Tensor):
                if value.is_floating_point() and _storage(value) not in self.inputs:
                    with torch.no_grad():
                        value.zero_()
                aligned = value.data_ptr() % 16 == 0
                described.append(("tensor", str(value.dtype).replace("torch.", ""), aligned))
            elif isinstance(value, int):
                described.append(("int", int(value)))
            else:
                described.append(("float",))
        meta = {k: v for k, v in constants.items() if k not in TILES}
        self.out.append(Launch(self.name, tuple(sorted(meta.items())), tuple(described)))


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


@contextmanager
def _recording(out: list, inputs: set[int]):
    """The kernels replaced by recorders (`launch.KERNELS` and the dropout-mask kernel)."""
    from urpe.kernels.triton import kernels as K
    from urpe.kernels.triton import launch

    saved = dict(launch.KERNELS), K.dropout_mask_kernel
    for name, fn in saved[0].items():
        launch.KERNELS[name] = _Recorder(name, fn.arg_names, inputs, out)
    K.dropout_mask_kernel = _Recorder("dropout_mask", saved[1].arg_names, inputs, out)
    try:
        yield
    finally:
        launch.KERNELS.update(saved[0])
        K.dropout_mask_kernel = saved[1]


@contextmanager
def _switches(call: Call):
    """torch's global switches a launch reads, as the call has them."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(call.deterministic)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(deterministic)


def _as_on_a_gpu(launch: Launch, call: Call) -> Launch:
    """The constants a GPU sets where the interpreter sets others (see the module docstring)."""
    import triton.language as tl

    meta = dict(launch.meta)
    if "UPCAST" in meta:
        meta["UPCAST"] = False
    if call.tf32 and call.dtype == "float32" and meta.get("PRECISION") == "ieee":
        meta["PRECISION"] = "tf32"
    if "ACC" in meta:  # a Triton dtype: its name, so that the launch pickles
        meta["ACC"] = {tl.float32: "float32", tl.float64: "float64"}[meta["ACC"]]
    return Launch(launch.kernel, tuple(sorted(meta.items())), launch.args)


def record(call: Call) -> list[Launch]:
    """The launches of one call, forward and backward (in this process: the interpreter must be
    on)."""
    import urpe

    (q, k, v), kwargs = _inputs(call)
    leaves = [q, k, v] + [t for t in _tensors(kwargs) if t.requires_grad]
    inputs = {_storage(t) for t in [q, k, v, *_tensors(kwargs)]}
    out: list[Launch] = []
    with _recording(out, inputs), _switches(call):
        result = urpe.attention(q, k, v, **kwargs)
        torch.autograd.grad(result.float().sum(), leaves, allow_unused=True)
    return [_as_on_a_gpu(launch, call) for launch in out]


def _tensors(kwargs: dict) -> list[torch.Tensor]:
    found = []
    for value in kwargs.values():
        if isinstance(value, torch.Tensor):
            found.append(value)
        for name in ("table", "index", "log_forget"):
            if isinstance(getattr(value, name, None), torch.Tensor):
                found.append(getattr(value, name))
    return found


def record_dropout_mask() -> list[Launch]:
    """The launch of the public `dropout_keep_mask` (the mask the kernels regenerate)."""
    from urpe.kernels.triton import dropout_keep_mask

    out: list[Launch] = []
    with _recording(out, set()):
        dropout_keep_mask(2, 4, 1000, 1024, 0.1, 1234, "cpu")
    return [Launch(x.kernel, x.meta, x.args) for x in out]


def _interpreting() -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    torch.set_num_threads(1)


def _record_or_refusal(call: Call) -> list[Launch] | str:
    try:
        return record(call)
    except (TypeError, ValueError) as error:  # a call the public function refuses launches nothing
        return f"{type(error).__name__}: {str(error).splitlines()[0]}"


def recorded(calls: list[Call]) -> dict[Call, list[Launch] | str]:
    """The launches of each call (or why the public call refused it), recorded in one worker
    process with the interpreter on."""
    with ProcessPoolExecutor(1, mp_context=get_context("spawn"), initializer=_interpreting) as pool:
        results = list(pool.map(_record_or_refusal, calls, chunksize=8))
        mask = pool.submit(record_dropout_mask).result()
    found = dict(zip(calls, results, strict=True))
    found[DROPOUT_MASK] = mask
    return found


DROPOUT_MASK = Call(dtype="float16", dropout=True)  # the key under which the mask kernel stands
