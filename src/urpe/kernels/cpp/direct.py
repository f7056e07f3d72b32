"""One op call for a remembered call that needs no gradient: the C++ kernel's decoding path.

A decoding step calls `urpe.attention` once per layer with the same kind of arguments, under
`torch.no_grad`. Once the call's plan is known (`urpe.kernels.plans`), everything that does not
depend on the tensors' values is fixed: the term kinds, the table columns a Toeplitz row reads,
the normalisation's code, the scale, the tile sizes. `direct_call(spec)` builds, once per plan,
a function that reads the Toeplitz rows and runs `urpe_cpp::forward_if_finite`, which checks q,
k and v for NaN/inf and runs the kernel in the same call. On a non-finite input it returns None
and the caller takes the full path, which applies the non-finite rule (`urpe.kernels.nonfinite`).

It covers what a decoding step passes: float32/float64, softmax or l2 (no statistic counted up
front, no overflow check), Toeplitz, dense or Decay terms or none (and relations, which only
compiled calls bring: a static KV cache's positions), any mask, no dropout, one batch dim.
Anything else (gradients, bf16, exp, relu2, dropout, documents) keeps the general path.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ..layout import FORWARD_SCHEMA, ForwardArgs
from ..nonfinite import guarded
from ..spec import AttentionSpec
from ..tables import Decay, Relation, Toeplitz
from .ops import FORWARD_TILES, KIND_CODES, NORMALIZATION_CODES, padded_columns
from .run import cpp_run

DIRECT_NORMALIZATIONS = ("softmax", "l2")  # no fixed statistic, no overflow check
DIRECT_DTYPES = (torch.float32, torch.float64)  # computed as they are: nothing to convert

Direct = Callable[[AttentionSpec], Tensor | None]


def direct_call(spec: AttentionSpec) -> Direct | None:
    """The one-call forward for calls of `spec`'s signature, or None where it does not apply."""
    if (
        spec.normalization not in DIRECT_NORMALIZATIONS  # (the built-in: cpp's table took it)
        or spec.dropout_p > 0.0
        or spec.document_ids is not None
        or len(spec.batch_shape) != 1
        or spec.is_empty
        or spec.q.dtype not in DIRECT_DTYPES
        or spec.k.dtype != spec.q.dtype
        or spec.v.dtype != spec.q.dtype
    ):
        return None
    terms = [_term_reader(t, spec) for t in (spec.bias, spec.gate)]
    if None in terms:
        return None
    read_bias, read_gate = terms
    bias_code, gate_code = _code(spec.bias), _code(spec.gate)
    mask = spec.attn_mask
    float_mask = mask is not None and mask.dtype != torch.bool
    if float_mask and mask.dtype != spec.q.dtype:
        return None
    scalars = (
        spec.is_causal,
        NORMALIZATION_CODES[spec.normalization],
        spec.scale,
        0.0,
        0,
        None,
        *FORWARD_TILES,
    )
    op = getattr(torch.ops.urpe_cpp, "forward_if_finite", None)
    if op is None:  # a kernel library built before this op existed
        return None
    op = op.default

    def run(call: AttentionSpec) -> Tensor | None:
        mask = call.attn_mask
        kpm = call.key_padding_mask
        out, _, finite = op(
            _contiguous(call.q),
            _contiguous(call.k),
            _contiguous(call.v),
            bias_code,
            *read_bias(call.bias),
            gate_code,
            *read_gate(call.gate),
            mask if float_mask else None,
            None if float_mask else mask,
            None if kpm is None else _contiguous(kpm),
            None,
            None,
            *scalars,
        )
        return out if finite else None

    return run


def _code(term) -> int:
    if term is None:
        return KIND_CODES["none"]
    if type(term) is Relation:
        return KIND_CODES["relation"]
    if type(term) is Decay:
        return KIND_CODES["decay"]
    return KIND_CODES["toeplitz" if type(term) is Toeplitz else "dense"]


def _term_reader(term, spec: AttentionSpec) -> Callable | None:
    """term -> (tensor, index) as the op takes it, for terms of this call's kind; None: not
    covered. A Relation's index was range-checked when the call was resolved (only the opaque
    op of compiled calls meets one: remembered plans never hold a Relation)."""
    if term is None:
        return _nothing
    dtype = spec.q.dtype
    if type(term) is Toeplitz:
        if term.table.dtype != dtype:
            return None
        columns = padded_columns(term.table.shape[1], spec.lq, spec.lk, term.table.device)
        return lambda t: (t.table.index_select(1, columns), None)
    if type(term) is Relation:
        if term.table.dtype != dtype:
            return None
        return _relation
    if type(term) is Decay:
        return _decay if term.log_forget.dtype == dtype else None
    if type(term) in (Tensor, torch.nn.Parameter) and term.dtype == dtype:
        return _same
    return None


def _nothing(term) -> tuple[None, None]:
    return None, None


def _same(term: Tensor) -> tuple[Tensor, None]:
    return term, None


def _decay(term: Decay) -> tuple[Tensor, None]:
    # The kernel reads c = cumsum(log_forget) (values checked when the call was resolved).
    return term.log_forget.cumsum(-1).contiguous(), None


def _relation(term: Relation) -> tuple[Tensor, Tensor]:
    index = term.index if term.index.dtype == torch.int64 else term.index.to(torch.int64)
    return _contiguous(term.table), _contiguous(index)


def _contiguous(t: Tensor) -> Tensor:
    return t if t.is_contiguous() else t.contiguous()


# Under torch.compile no value may be read while tracing, so the non-finite rule would run as
# tensor ops around the kernel: masked copies of q, k, v (a whole static KV cache per layer and
# step), visibility counts and a fill, about as costly as a decoding call itself. A call that
# needs no gradient runs instead as this one opaque op, whose body runs eagerly at run time,
# where the CPU's values may be read: the one-call path, or (non-finite inputs) the rule
# applied directly (issue 28: a static cache under torch.compile).
def _guarded_forward(*flat) -> Tensor:
    spec = _spec_of(ForwardArgs(*flat))
    run = direct_call(spec)
    out = run(spec) if run is not None else None
    if out is None:
        out, _ = guarded(cpp_run, spec)
    return out


def _spec_of(args: ForwardArgs) -> AttentionSpec:
    return AttentionSpec(
        args.q,
        args.k,
        args.v,
        _as_term(args.bias, args.bias_index, args.bias_kind),
        _as_term(args.gate, args.gate_index, args.gate_kind),
        args.attn_mask,
        args.key_padding_mask,
        args.is_causal,
        args.normalization,
        args.scale,
        args.dropout_p,
        args.dropout_seed,
        (args.q.shape[0],),
        args.document_ids,
    )


def _as_term(tensor: Tensor | None, index: Tensor | None, kind: str):
    if kind == "toeplitz":
        return Toeplitz(tensor)
    if kind == "relation":
        return Relation(tensor, index, in_range=True)  # checked when the call was resolved
    if kind == "decay":
        return Decay(tensor)
    return tensor


GUARDED_FORWARD = torch.library.custom_op(
    "urpe::cpp_guarded_forward",
    _guarded_forward,
    mutates_args=(),
    schema=FORWARD_SCHEMA.replace("-> (Tensor, Tensor)", "-> Tensor"),
)
GUARDED_FORWARD.register_fake(lambda *flat: _output_fake(ForwardArgs(*flat)))


def _output_fake(args: ForwardArgs) -> Tensor:
    b, h, lq, _ = args.q.shape
    return args.q.new_empty(b, h, lq, args.v.shape[-1])


def guarded_forward(spec: AttentionSpec) -> Tensor | None:
    """The call as one opaque op that applies the non-finite rule itself (above), or None where
    that does not fit: gradients wanted, a vmap, an overflow check to follow (exp)."""
    if spec.norm.overflows or torch._C._are_functorch_transforms_active() or _records_grad(spec):
        return None
    return GUARDED_FORWARD(*ForwardArgs.from_spec(spec))


def _records_grad(spec: AttentionSpec) -> bool:
    if not torch.is_grad_enabled():
        return False
    args = ForwardArgs.from_spec(spec)
    return any(t is not None and t.requires_grad for t in args.tensors)
