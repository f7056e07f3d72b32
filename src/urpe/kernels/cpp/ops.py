"""The C++ kernel's layers, on the raw-op layout every kernel shares.

`cpp_forward(ForwardArgs)` and `cpp_backward(BackwardArgs)` bring the arguments into the form
the C++ ops take (the compute dtype, contiguous, a Toeplitz table read out at every offset of
the call, the statistic of exp/relu2 counted up front) and turn the C++ gradients back into
gradients of the caller's tensors. `define_attention_ops` puts them behind
`urpe::cpp_attention_r2_forward` / `_backward` (`OPS`) with fake implementations, vmap rules and an
autograd Function, as for the blockwise and Triton kernels, so torch.func and torch.compile
compose with them.

`NoGradForward` is the forward of calls that need no gradient, made once per kind of call (a
prepared call keeps one, with the op's arguments that the kind fixes, `OpArguments`): one op
call that also finds NaN/inf in q, k and v (`urpe_cpp::forward_if_finite`), returning None
where it met one; in plain eager mode the same function called through the library's Python
entry (`entry.cpp`), without the dispatcher. `GUARDED_FORWARD` runs it as one opaque op under
torch.compile, applying the non-finite rule itself at run time, where values may be read. The
ops' arguments after q, k, v are laid out in `arguments`.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from ..composable import define_attention_ops
from ..dtypes import HALF, compute_dtype
from ..host import dispatcher_free
from ..layout import FORWARD_SCHEMA, BackwardArgs, ForwardArgs
from ..nonfinite import guarded
from ..normalization import NORMALIZATIONS
from ..spec import AttentionSpec
from .arguments import (
    BACKWARD_TILES,
    FORWARD_TILES,
    NO_TERM_ARGUMENTS,
    OpArguments,
    as_operand,
    bf16_products,
    laid_out,
    operands,
    output_like,
    reads_in_place,
    table_columns,
)
from .build import python_entry

# Backward work items wanted per thread: with fewer (batch, kv head) pairs than that, the query
# blocks are split into ranges with their own dk/dv copies, so a slowed thread can be helped.
ITEMS_PER_THREAD = 4


def _raw_terms(call: ForwardArgs) -> tuple[tuple, tuple]:
    """The op arguments' bias and gate, each as (tensor, index, kind)."""
    return (call.bias, call.bias_index, call.bias_kind), (
        call.gate,
        call.gate_index,
        call.gate_kind,
    )


def _forward_arguments(call: ForwardArgs, tiles: tuple[int, int]) -> tuple:
    """The op arguments after q, k, v of the forward op's arguments."""
    blocks = (call.block_q, call.block_k)
    return OpArguments(call, tiles, blocks).of(call, _raw_terms(call))


@functools.cache
def _op(name: str):
    """The C++ op's overload, looked up once (through torch.ops it costs a microsecond a call),
    as the builtin that `OpOverload.__call__` forwards to (its Python frame costs about 0.3 us
    a call, a tenth of a decoding step's time around the kernel)."""
    overload = getattr(torch.ops.urpe_cpp, name).default
    return getattr(overload, "_op", overload)


@functools.cache
def _entry(name: str):
    """The loaded kernel's function `name` called without torch's dispatcher (entry.cpp), or
    None where the library has no Python entry."""
    module = python_entry()
    return None if module is None else getattr(module, name, None)


def forget_step():
    """The kernel's FoX decoding step (`urpe_cpp::forget_step`, forget_step.h) through the
    library's Python entry, or None where no kernel with one is loaded. The caller calls it
    only where the dispatcher would add nothing (`host.dispatcher_free`, no gradient)."""
    return _entry("forget_step")


def forward_fake(args: ForwardArgs) -> tuple[Tensor, Tensor]:
    """The forward op's outputs as `cpp_forward` lays them out."""
    dtype = compute_dtype(args.q.dtype)
    b, h, lq, _ = args.q.shape
    return output_like(args.q, args.v, dtype), args.q.new_empty(b, h, lq, 1, dtype=dtype)


def cpp_forward(call: ForwardArgs) -> tuple[Tensor, Tensor]:
    """(out (B, H, Lq, Dv) laid out as `output_like`, row statistic (B, H, Lq, 1)), both in the
    compute dtype."""
    out, stat = _op("forward")(*operands(call), *_forward_arguments(call, FORWARD_TILES))
    return out, stat.unsqueeze(-1)


def cpp_forward_if_finite(call: ForwardArgs) -> tuple[Tensor, Tensor, bool]:
    """`cpp_forward` for a call with gradients whose q, k and v nobody checked: (out, stat,
    True), or (empty, empty, False) where a row that a computed tile reads holds NaN/inf
    (`urpe_cpp::forward_checked_with_stat`)."""
    out, stat, finite = _op("forward_checked_with_stat")(
        *operands(call), *_forward_arguments(call, FORWARD_TILES)
    )
    return out, stat.unsqueeze(-1), finite


def _output_rows(out: Tensor, dtype: torch.dtype) -> Tensor:
    """The forward's output as the backward reads it: where it lies (only one pass over its
    rows reads it, at any length)."""
    return as_operand(out, dtype, in_place=True)


def _term_gradient(kind: str, tensor: Tensor, grad: Tensor, lq: int, lk: int) -> Tensor:
    """The C++ gradient of a term's tensor as the gradient of the caller's tensor."""
    if kind == "toeplitz":  # per offset (the padding dropped) -> per table column
        offsets = lq + lk - 1
        if lq == lk and tensor.shape[1] == offsets:  # a table of exactly the call's offsets
            return grad[:, :offsets].to(tensor.dtype)  # (its columns: no sum, no clipping)
        columns = table_columns(tensor.shape[1], lq, lk, tensor.device)[:offsets]
        grad = grad.new_zeros(tensor.shape).index_add_(1, columns, grad[:, :offsets])
    elif kind == "decay":  # d c -> d log_forget: c_t sums log_forget_s for s <= t
        grad = grad.flip(-1).cumsum(-1).flip(-1)
    return grad.to(tensor.dtype)


def cpp_backward(args: BackwardArgs):
    """(dq, dk, dv, d bias, d gate, d float attn_mask); None for a term not asked for."""
    call = args.forward
    dtype = compute_dtype(call.q.dtype)
    lq, lk = call.q.shape[2], call.k.shape[2]
    operand = call.q.dtype if bf16_products(call.q.dtype) else dtype  # dO as q, k, v go in
    in_place = reads_in_place(call.q, call.k)
    grad_out = as_operand(args.grad_out, operand, in_place)
    stat = args.stat.reshape(args.stat.shape[:3]).contiguous()  # (B, H, Lq)
    dq, dk, dv, *term_grads = _op("backward")(
        grad_out,
        stat,
        _output_rows(args.out, dtype),  # (B, H, Lq, Dv): for sum_e dO O per row
        *operands(call),
        *_forward_arguments(call, BACKWARD_TILES),
        *args.needs,
        ITEMS_PER_THREAD,
    )
    grads = []
    for (kind, tensor), needed, grad in zip(
        (
            (call.bias_kind, call.bias),
            (call.gate_kind, call.gate),
            ("dense", call.attn_mask),
        ),
        args.needs,
        term_grads,
        strict=True,
    ):
        useful = needed and tensor is not None and kind != "none" and grad.numel() > 0
        grads.append(_term_gradient(kind, tensor, grad, lq, lk) if useful else None)
    return (dq.to(call.q.dtype), dk.to(call.k.dtype), dv.to(call.v.dtype), *grads)


# Inductor's and AOTAutograd's on-disk caches key a compiled graph by its code, which names the
# ops it calls but not the strides their fakes promise: where an op's output layout changes, its
# name must change too, or a graph compiled by an earlier urpe is loaded and fails its stride
# check. Revision 2: the output lies in (B, Lq, H, Dv) memory.
REVISION = 2
OPS = f"cpp_attention_r{REVISION}"  # urpe::{OPS}_forward / _backward
CPP = define_attention_ops(OPS, cpp_forward, cpp_backward, forward_fake, cpp_forward_if_finite)


# ---------------------------------------------------------------------------------------------
# Calls that need no gradient


def checks_finite(call: AttentionSpec | ForwardArgs) -> bool:
    """Whether `urpe_cpp::forward_if_finite` takes the call: no documents, no statistic known up
    front, no dropout (the others run `urpe_cpp::forward_checked`, with the forward's
    arguments)."""
    return (
        call.document_ids is None
        and NORMALIZATIONS[call.normalization].fixed_statistic is None
        and call.dropout_p == 0.0
    )


class NoGradForward:
    """The forward of calls that need no gradient, for one kind of call (`OpArguments`):
    calling it on a call of that kind gives (B, H, Lq, Dv) in q's dtype, laid out as
    `output_like`, or None where q, k or v hold a NaN or inf the call reads (or a logit or
    output came out non-finite: the caller then asks). A prepared call keeps one
    (`urpe.kernels.cpp.CppRun`); the compiled op's body makes one per call.

    One op call, `urpe_cpp::forward_if_finite`, which finds non-finite numbers in the rows of
    q, k and v that the tiles it computes read (for one query row per head: in the logits and
    outputs it computes, so that a decoding step reads its KV cache once), never in those of
    skipped tiles (a padded tail). Calls it takes no arguments for (`checks_finite`) run
    `urpe_cpp::forward_checked`, the same with the forward's arguments. Where the dispatcher
    would only call the function (`host.dispatcher_free`), `forward_if_finite` is called
    through the library's Python entry instead: the same function, the same arguments.
    """

    def __init__(
        self,
        call: AttentionSpec | ForwardArgs,
        terms: tuple[tuple, tuple],
        blocks: tuple[int, int] = (0, 0),
    ):
        """terms: the call's bias's and gate's (tensor, index, kind) (`term_arguments`); the
        kind of call fixes all but their tensors."""
        self.checked = checks_finite(call)
        self.arguments = OpArguments(call, FORWARD_TILES, blocks, self.checked, terms)
        name = "forward_if_finite" if self.checked else "forward_checked"
        self.op = _op(name)
        self.entry = _entry(name)  # the same function without the dispatcher (None: absent)
        self.dtype = call.q.dtype
        operand = self.dtype
        if operand in HALF and not bf16_products(operand):
            operand = torch.float32
        self.converts = operand != self.dtype  # (q, k, v share a dtype: the kind says so)
        self.casts = compute_dtype(self.dtype) != self.dtype  # the output, back to q's dtype
        self.fixed = self.arguments.fixed  # every argument, where the kind fixes them all

    def __call__(
        self, call: AttentionSpec | ForwardArgs, terms: tuple[tuple, tuple]
    ) -> Tensor | None:
        """terms: the bias's and the gate's (tensor, index, kind) (`term_arguments`)."""
        q, k, v = call.q, call.k, call.v
        if self.converts or not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous()):
            q, k, v = operands(call)
        arguments = self.fixed
        if arguments is None:
            arguments = self.arguments.of(call, terms)
            (bias, bias_index, _), (gate, gate_index, _) = terms
            tensors = (q, k, v, bias, bias_index, gate, gate_index, call.attn_mask)
            tensors += (call.key_padding_mask,)
        else:  # (no term or mask: q, k and v are the only tensors)
            tensors = (q, k, v)
        op = self.op
        if self.entry is not None and dispatcher_free(tensors):
            op = self.entry  # the same function, without the dispatcher's work per argument
        out, finite = op(q, k, v, *arguments)
        if not finite:
            return None
        return out.to(self.dtype) if self.casts else out


def spec_terms(spec: AttentionSpec) -> tuple[tuple, tuple]:
    """A spec's bias and gate as the raw ops' (tensor, index, kind)."""
    bias, gate = spec.bias, spec.gate  # (`Term`s: `term_arguments` without its `as_term`)
    return (
        NO_TERM_ARGUMENTS if bias is None else (*bias.raw(), bias.kind),
        NO_TERM_ARGUMENTS if gate is None else (*gate.raw(), gate.kind),
    )


# Under torch.compile a call that needs no gradient runs as one opaque op whose body runs
# eagerly at run time, where the CPU's values may be read: `NoGradForward`, or (non-finite
# inputs) the non-finite rule applied directly. Traced instead, the rule would be tensor ops
# around the kernel (masked copies of q, k, v: a whole static KV cache per layer and step),
# about as costly as a decoding call itself. Registered as a plain CPU kernel, not with
# `torch.library.custom_op`, whose autograd, redispatch and dynamo-disabling layers cost about
# 10 us per call (the op is only called where nothing records a gradient, from compiled
# graphs, where dynamo is off already).
def _guarded_forward(*flat) -> Tensor:
    call = ForwardArgs(*flat)
    terms = _raw_terms(call)
    out = NoGradForward(call, terms, (call.block_q, call.block_k))(call, terms)
    if out is None:  # (the rule below makes q, k and v finite)
        spec = call.to_spec().replace(finite=True)
        out, _ = guarded(_forward_finite, spec, finds_nonfinite=False)
    return laid_out(out)


def _forward_finite(spec: AttentionSpec) -> Tensor:
    """The forward of a call whose q, k and v hold no NaN/inf."""
    out, _ = cpp_forward(ForwardArgs.from_spec(spec))
    return out if out.dtype == spec.q.dtype else out.to(spec.q.dtype)


_LIBRARY = torch.library.Library("urpe", "FRAGMENT")
GUARDED = f"cpp_guarded_forward_r{REVISION}"  # named by the layout's revision (above)
_LIBRARY.define(GUARDED + FORWARD_SCHEMA.replace("-> (Tensor, Tensor)", "-> Tensor"))
_LIBRARY.impl(GUARDED, _guarded_forward, "CPU")
torch.library.register_fake(
    f"urpe::{GUARDED}",
    lambda *flat: output_like(flat[0], flat[2], flat[0].dtype),
    lib=_LIBRARY,
)
GUARDED_FORWARD = getattr(torch.ops.urpe, GUARDED).default
