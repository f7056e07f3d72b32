"""One op call for a remembered call that needs no gradient: the C++ kernel's decoding path.

A decoding step calls `urpe.attention` once per layer with the same kind of arguments, under
`torch.no_grad`. Once the call's plan is known (`urpe.kernels.plans`), everything that does not
depend on the tensors' values is fixed: the term kinds, the normalisation's code, the scale, the
tile sizes (a Toeplitz row's columns are looked up per call: Lk grows with a KV cache).
`direct_call(spec)` builds, once per plan, a function that reads the Toeplitz rows and runs
`urpe_cpp::forward_if_finite`, which checks q, k and v for NaN/inf and runs the kernel in the
same call (for one query row per head, by the logits and output rows the kernel computes: a NaN
or inf in any row a computed pair reads makes one of them non-finite, and Lq x Lk logits are far
fewer than the Lk x (D + Dv) keys and values). On a non-finite input it returns None and the
caller takes the full path, which applies the non-finite rule (`urpe.kernels.nonfinite`).

It covers what a decoding step passes: float32/float64, softmax or l2 (no statistic counted up
front, no overflow check), Toeplitz, dense or Decay terms or none (and relations, which only
compiled calls bring: remembered plans never hold one), any mask, no dropout, one batch dim.
Anything else (gradients, bf16, exp, relu2, dropout, documents) keeps the general path.

Under torch.compile the same path runs inside one opaque op (`guarded_forward`, below), looked
up by the call's signature rather than rebuilt per call, with Toeplitz tables read out at the
call's offsets by the graph itself (`ROWS`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ..layout import FORWARD_SCHEMA, N_TENSORS, ForwardArgs
from ..nonfinite import guarded
from ..spec import AttentionSpec
from ..tables import Decay, Relation, Toeplitz
from ..watched import LISTENERS
from .ops import (
    FORWARD_TILES,
    KIND_CODES,
    LANES,
    NORMALIZATION_CODES,
    REVISION,
    TABLE_IN_PLACE,
    decoding_columns,
    laid_out,
    output_like,
    padded_columns,
)
from .run import cpp_run

DIRECT_NORMALIZATIONS = ("softmax", "l2")  # no fixed statistic, no overflow check
DIRECT_DTYPES = (torch.float32, torch.float64)  # computed as they are: nothing to convert

Direct = Callable[[AttentionSpec], Tensor | None]
# (q, k, v, bias, bias_index, gate, gate_index, attn_mask, key_padding_mask) -> out, or None
# (non-finite inputs): the call's tensors as the raw ops take them (`ForwardArgs`' first nine)
RawDirect = Callable[..., Tensor | None]


def direct_call(spec: AttentionSpec) -> Direct | None:
    """The one-call forward for calls of `spec`'s signature, or None where it does not apply."""
    raw = raw_direct_call(spec)
    if raw is None:
        return None
    if spec.attn_mask is None and spec.key_padding_mask is None:
        lean = _tables_only_call(spec)
        if lean is not None:
            return lean
    bias_parts, gate_parts = _parts(spec.bias), _parts(spec.gate)

    def run(call: AttentionSpec) -> Tensor | None:
        return raw(
            call.q,
            call.k,
            call.v,
            *bias_parts(call.bias),
            *gate_parts(call.gate),
            call.attn_mask,
            call.key_padding_mask,
        )

    return run


def _tables_only_call(spec: AttentionSpec) -> Direct | None:
    """`direct_call` for the usual decoding call, in one Python frame: no masks, each term None
    or a Toeplitz table (checked by `raw_direct_call`). None for any other call. About 2 us
    less per call than the general closure (measured, one thread), a tenth of the op's time.
    Its `from_arguments(q, k, v, bias, gate)` takes the call's own tensors (no spec built)."""
    terms = (spec.bias, spec.gate)
    if any(t is not None and type(t) is not Toeplitz for t in terms):
        return None
    with_bias, with_gate = (t is not None for t in terms)
    scalars = (spec.is_causal, NORMALIZATION_CODES[spec.normalization], spec.scale, *FORWARD_TILES)
    op = _forward_if_finite()._op  # the overload's own entry: one Python frame less

    def from_arguments(q, k, v, bias, gate) -> Tensor | None:
        lq, lk = q.shape[2], k.shape[2]  # Lk grows with a KV cache: not fixed by the plan
        bias_kind = gate_kind = NO_TERM
        if with_bias:
            bias, bias_kind = _table_or_rows(bias.table, lq, lk)
        if with_gate:
            gate, gate_kind = _table_or_rows(gate.table, lq, lk)
        out, finite = op(
            q if q.is_contiguous() else q.contiguous(),
            k if k.is_contiguous() else k.contiguous(),
            v if v.is_contiguous() else v.contiguous(),
            bias_kind,
            bias,
            None,
            gate_kind,
            gate,
            None,
            None,
            None,
            None,
            *scalars,
        )
        return out if finite else None

    def run(call: AttentionSpec) -> Tensor | None:
        return from_arguments(call.q, call.k, call.v, call.bias, call.gate)

    run.from_arguments = from_arguments  # (plans.Plan.direct_from_arguments)
    return run


def _table_or_rows(table: Tensor, lq: int, lk: int) -> tuple[Tensor, int]:
    """(tensor, kind) for the op: the table itself where its offsets -K..K cover the call's
    farthest offset and the rows' padding (no rows built: about a third of a gated decoding
    call's instructions outside the kernel), else its rows at the call's offsets."""
    k, odd = divmod(table.shape[1], 2)
    if odd and k >= lk - 1 and k >= lq - 1 + LANES:
        return table, TABLE_IN_PLACE
    return _toeplitz_rows(table, None, lq, lk)[0], TOEPLITZ_ROWS


NO_TERM, TOEPLITZ_ROWS = KIND_CODES["none"], KIND_CODES["toeplitz"]


def _forward_if_finite():
    """The kernel's checked decoding op, or None (a library built before it existed)."""
    op = getattr(torch.ops.urpe_cpp, "forward_if_finite", None)
    return None if op is None else op.default


def raw_direct_call(
    spec: AttentionSpec, rows_given: tuple[bool, bool] = (False, False)
) -> RawDirect | None:
    """`direct_call` for the call's tensors as the raw ops take them (a term as its tensor and
    index), or None where it does not apply. rows_given: (bias, gate) is a Toeplitz term whose
    table comes already read out at every offset of the call (`ROWS`)."""
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
    terms = [
        _term_reader(t, spec, r) for t, r in zip((spec.bias, spec.gate), rows_given, strict=True)
    ]
    if None in terms:
        return None
    read_bias, read_gate = terms
    bias_code, gate_code = _code(spec.bias), _code(spec.gate)
    mask = spec.attn_mask
    float_mask = mask is not None and mask.dtype != torch.bool
    if float_mask and mask.dtype != spec.q.dtype:
        return None
    scalars = (spec.is_causal, NORMALIZATION_CODES[spec.normalization], spec.scale, *FORWARD_TILES)
    op = _forward_if_finite()
    if op is None:
        return None

    def run(q, k, v, bias, bias_index, gate, gate_index, mask, kpm) -> Tensor | None:
        # (contiguity checked inline: a decoding step makes this call once per layer)
        lengths = q.shape[2], k.shape[2]  # Lk grows with a KV cache: not fixed by the plan
        out, finite = op(
            q if q.is_contiguous() else q.contiguous(),
            k if k.is_contiguous() else k.contiguous(),
            v if v.is_contiguous() else v.contiguous(),
            bias_code,
            *read_bias(bias, bias_index, *lengths),
            gate_code,
            *read_gate(gate, gate_index, *lengths),
            mask if float_mask else None,
            None if float_mask else mask,
            None if kpm is None else _contiguous(kpm),
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


def _parts(term) -> Callable:
    """term -> (tensor, index), the raw ops' form, for terms of this one's type."""
    if term is None:
        return _no_parts
    if type(term) is Toeplitz:
        return _table_parts
    if type(term) is Relation:
        return _relation_parts
    if type(term) is Decay:
        return _decay_parts
    return _tensor_parts


def _no_parts(term) -> tuple[None, None]:
    return None, None


def _table_parts(term: Toeplitz) -> tuple[Tensor, None]:
    return term.table, None


def _relation_parts(term: Relation) -> tuple[Tensor, Tensor]:
    return term.table, term.index


def _decay_parts(term: Decay) -> tuple[Tensor, None]:
    return term.log_forget, None


def _tensor_parts(term: Tensor) -> tuple[Tensor, None]:
    return term, None


def _term_reader(term, spec: AttentionSpec, rows_given: bool) -> Callable | None:
    """(tensor, index, Lq, Lk) -> (tensor, index) as the op takes them, for terms of this call's
    kind (nothing read from the spec's Lk: a plan serves a growing KV cache, `plans.kin`);
    None: not covered. A Relation's index was range-checked when the call was resolved (only
    the opaque op of compiled calls meets one: remembered plans never hold a Relation)."""
    if term is None:
        return _nothing
    dtype = spec.q.dtype
    if type(term) is Toeplitz:
        if term.table.dtype != dtype:
            return None
        return _nothing_to_read if rows_given else _toeplitz_rows
    if type(term) is Relation:
        if term.table.dtype != dtype:
            return None
        return _relation
    if type(term) is Decay:
        return _decay if term.log_forget.dtype == dtype else None
    if type(term) in (Tensor, torch.nn.Parameter) and term.dtype == dtype:
        return _nothing_to_read
    return None


def _nothing(tensor: None, index: None, lq: int, lk: int) -> tuple[None, None]:
    return None, None


def _nothing_to_read(tensor: Tensor, index: None, lq: int, lk: int) -> tuple[Tensor, None]:
    return tensor, None


def _toeplitz_rows(table: Tensor, index: None, lq: int, lk: int) -> tuple[Tensor, None]:
    # the table at every offset of the call, then padding
    return table.index_select(1, decoding_columns(table.shape[1], lq, lk, table.device)), None


def _decay(log_forget: Tensor, index: None, lq: int, lk: int) -> tuple[Tensor, None]:
    # The kernel reads c = cumsum(log_forget) (values checked when the call was resolved).
    return log_forget.cumsum(-1).contiguous(), None


def _relation(table: Tensor, index: Tensor, lq: int, lk: int) -> tuple[Tensor, Tensor]:
    index = index if index.dtype == torch.int64 else index.to(torch.int64)
    return _contiguous(table), _contiguous(index)


def _contiguous(t: Tensor) -> Tensor:
    return t if t.is_contiguous() else t.contiguous()


# Under torch.compile no value may be read while tracing, so the non-finite rule would run as
# tensor ops around the kernel: masked copies of q, k, v (a whole static KV cache per layer and
# step), visibility counts and a fill, about as costly as a decoding call itself. A call that
# needs no gradient runs instead as this one opaque op, whose body runs eagerly at run time,
# where the CPU's values may be read: the one-call path, or (non-finite inputs) the rule
# applied directly (issue 28: a static cache under torch.compile).
def _guarded_forward(*flat) -> Tensor:
    key = _signature(flat)
    run = OPAQUE_CALLS.get(key, _UNKNOWN)
    if run is _UNKNOWN:  # once per signature: a decoding step repeats the same few
        if len(OPAQUE_CALLS) >= CAPACITY:
            OPAQUE_CALLS.clear()
        args = ForwardArgs(*flat)
        rows = (args.bias_kind == ROWS, args.gate_kind == ROWS)
        run = OPAQUE_CALLS[key] = raw_direct_call(_spec_of(args), rows)
    out = None if run is None else run(*flat[:9])
    if out is None:
        out, _ = guarded(cpp_run, _spec_of(ForwardArgs(*flat)))
    return laid_out(out)  # as the fake promises


# signature -> the raw one-call forward, or None where it does not apply; like remembered plans
# (`urpe.kernels.plans`) it depends on no tensor value, and a registry change clears it
OPAQUE_CALLS: dict[tuple, RawDirect | None] = {}
CAPACITY = 64
_UNKNOWN = object()
LISTENERS.append(OPAQUE_CALLS.clear)


def _signature(flat: tuple) -> tuple:
    """What `raw_direct_call` decides from, spelled out (a decoding step asks once per layer):
    q, k, v's dtypes and shapes, the terms' and the mask's (a Toeplitz table's width gives its
    columns), whether a padding mask or documents come, the device, then the scalar arguments.
    A Relation's index is read per call (its dtype), the dropout seed only by the general path."""
    q, k, v, bias, _, gate, _, mask, padding, documents = flat[:10]
    return (
        q.dtype,
        q.shape,
        k.dtype,
        k.shape,
        v.dtype,
        v.shape,
        q.device,
        None if bias is None else (bias.dtype, bias.shape),
        None if gate is None else (gate.dtype, gate.shape),
        None if mask is None else mask.dtype,
        padding is None,
        documents is None,
        *flat[N_TENSORS:],
    )


def _spec_of(args: ForwardArgs) -> AttentionSpec:
    lengths = args.q.shape[2], args.k.shape[2]
    return AttentionSpec(
        args.q,
        args.k,
        args.v,
        _as_term(args.bias, args.bias_index, args.bias_kind, *lengths),
        _as_term(args.gate, args.gate_index, args.gate_kind, *lengths),
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


def _as_term(tensor: Tensor | None, index: Tensor | None, kind: str, lq: int, lk: int):
    if kind == ROWS:
        return Toeplitz(_table_of_rows(tensor, lq, lk))
    if kind == "toeplitz":
        return Toeplitz(tensor)
    if kind == "relation":
        return Relation(tensor, index, in_range=True)  # checked when the call was resolved
    if kind == "decay":
        return Decay(tensor)
    return tensor


# Registered as a plain CPU kernel, not with `torch.library.custom_op`, whose autograd,
# redispatch and dynamo-disabling layers cost about 10 us per call in Python (measured on a
# decoding step: as much as the rest of the body): the op is only ever called where nothing
# records a gradient (`guarded_forward`), from compiled graphs, where dynamo is off already.
_LIBRARY = torch.library.Library("urpe", "FRAGMENT")
GUARDED = f"cpp_guarded_forward_r{REVISION}"  # named by the layout's revision (ops.py)
_LIBRARY.define(GUARDED + FORWARD_SCHEMA.replace("-> (Tensor, Tensor)", "-> Tensor"))
_LIBRARY.impl(GUARDED, _guarded_forward, "CPU")
torch.library.register_fake(
    f"urpe::{GUARDED}", lambda *flat: _output_fake(ForwardArgs(*flat)), lib=_LIBRARY
)
GUARDED_FORWARD = getattr(torch.ops.urpe, GUARDED).default


def _output_fake(args: ForwardArgs) -> Tensor:
    return output_like(args.q, args.v, args.q.dtype)


def guarded_forward(spec: AttentionSpec) -> Tensor | None:
    """The call as one opaque op that applies the non-finite rule itself (above), or None where
    that does not fit: gradients wanted, a vmap, an overflow check to follow (exp)."""
    if spec.norm.overflows or torch._C._are_functorch_transforms_active() or _records_grad(spec):
        return None
    args = ForwardArgs.from_spec(spec)
    if not spec.is_empty:
        args = args._replace(**_as_rows(spec, "bias"), **_as_rows(spec, "gate"))
    return GUARDED_FORWARD(*args)


# The opaque op's own term kind: a Toeplitz table already read out at every offset of the call,
# as the C++ loops read it (`ops.toeplitz_rows`). Made by tensor ops in the caller's graph, where
# the compiler fuses them with what built the table (a static cache's shifted table: one gather),
# instead of by an index_select in the op's Python body on every call.
ROWS = "toeplitz rows"


def _as_rows(spec: AttentionSpec, name: str) -> dict:
    term = getattr(spec, name)
    if type(term) is not Toeplitz or term.table.dtype != spec.q.dtype:
        return {}
    table = term.table
    columns = padded_columns.__wrapped__(table.shape[1], spec.lq, spec.lk, table.device)
    return {name: table.index_select(1, columns), f"{name}_kind": ROWS}


def _table_of_rows(rows: Tensor, lq: int, lk: int) -> Tensor:
    """Back from rows (H|1, Lq + Lk - 1 + LANES) to a Toeplitz table that gives the same term at
    (Lq, Lk): width 2M+1, M = max(Lq, Lk) - 1, so no offset of the call is clipped; row entry e
    holds offset e - (Lk - 1). For the general path (non-finite inputs) only."""
    m = max(lq, lk) - 1
    entries = torch.arange(-m, m + 1, device=rows.device) + (lk - 1)
    return rows.index_select(1, entries.clamp(0, lq + lk - 2))


def _records_grad(spec: AttentionSpec) -> bool:
    if not torch.is_grad_enabled():
        return False
    args = ForwardArgs.from_spec(spec)
    return any(t is not None and t.requires_grad for t in args.tensors)
