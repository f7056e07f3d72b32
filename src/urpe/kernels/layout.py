"""The raw attention ops' arguments, declared once.

Every kernel that sits behind a pair of custom ops (the blockwise kernel, the Triton
kernel) takes the same arguments, in flash-attention's raw-op style: tensors and scalars only, so
that `torch.library` can register them and `torch.compile` can trace through them.
`ForwardArgs` declares them (name, type, order, meaning) and `BackwardArgs` adds what the
backward pass needs; the ops' schemas, the vmap rules' positional indices, the fake
implementations and the kernels' own reads all come from these two declarations
(`composable.define_attention_ops`).

    forward(ForwardArgs)   -> (out (B, H, Lq, Dv), row statistic (B, H, Lq, ...))
    backward(BackwardArgs) -> (dq, dk, dv, d bias, d gate, d attn_mask)

A bias or gate travels as (tensor, index, kind): its `Term.raw()` and its kind's name ("none"
for no term), from which an op's body rebuilds the term (`term_of`): "dense" (a (B|1, H|1, Lq|1,
Lk|1) tensor), "toeplitz" (a table (H|1, 2K+1) over clamped offsets), "relation" (a table
(H|1, R) with a range-checked (B|1, Lq, Lk) int64 index), "decay" (a `Decay`'s log_forget,
(B|1, H|1, Lk); a bias only), "cross_decay" (a `CrossDecay`'s c, (B|1, H|1, Lq + Lk)) or a kind
registered later (`terms.TERM_KINDS`). `document_ids` is (B|1, Lk) integer (or (B|1, Lq + Lk):
see the field) or None. Every tensor except a table and the seed has the batch as dim 0, B or
1 (broadcast).
"""

from __future__ import annotations

import typing
from typing import NamedTuple

from torch import Tensor

from .spec import AttentionSpec
from .terms import TERM_KINDS, PositionTerm, Term, as_term

# Kinds whose tensor is a per-head table shared by the batch (a vmap must not fold a batched one)
TABLE_KINDS = ("toeplitz", "relation")
BUILT_IN_KINDS = ("none", "dense", "toeplitz", "relation", "decay", "cross_decay")


def term_arguments(term: PositionTerm | None) -> tuple[Tensor | None, Tensor | None, str]:
    """A bias or gate (a `Term`, or a tensor: dense) as the raw ops' (tensor, index, kind)."""
    if term is None:
        return None, None, "none"
    term = as_term(term)
    tensor, index = term.raw()
    return tensor, index, term.kind


def term_of(tensor: Tensor | None, index: Tensor | None, kind: str) -> Term | None:
    """The term the raw ops' (tensor, index, kind) stand for (None: "none")."""
    if kind == "none" or tensor is None:
        return None
    return TERM_KINDS[kind].from_raw(tensor, index)


class ForwardArgs(NamedTuple):
    """The forward op's arguments, in order (shapes as in `AttentionSpec`)."""

    q: Tensor  # (B, H, Lq, D)
    k: Tensor  # (B, Hkv, Lk, D)
    v: Tensor  # (B, Hkv, Lk, Dv)
    bias: Tensor | None  # per bias_kind (module docstring)
    bias_index: Tensor | None  # (B|1, Lq, Lk) int64 for a "relation" bias
    gate: Tensor | None
    gate_index: Tensor | None
    attn_mask: Tensor | None  # (B|1, H|1, Lq|1, Lk|1): bool (True takes part) or float (added)
    key_padding_mask: Tensor | None  # (B|1, Lk) bool, True = padded
    # (B|1, Lk) integer: query i sees key j iff same document; or (B|1, Lq + Lk), the queries'
    # ids given apart (`masks.query_documents`; the blockwise and C++ kernels read that form)
    document_ids: Tensor | None
    # int64 tensor (no host sync where it is made): the seed, or (seed, first row, rows, first
    # column, columns) placing these weights in a larger matrix (`dropout.seed_placement`)
    dropout_seed: Tensor | None
    bias_kind: str
    gate_kind: str
    is_causal: bool
    normalization: str
    scale: float
    dropout_p: float
    block_q: int  # tile sizes (queries x keys); 0: the kernel's own choice
    block_k: int

    @classmethod
    def from_spec(cls, spec: AttentionSpec, block_q: int = 0, block_k: int = 0) -> ForwardArgs:
        """The op's arguments for a resolved call (the seed as the spec holds it)."""
        bias, bias_index, bias_kind = term_arguments(spec.bias)
        gate, gate_index, gate_kind = term_arguments(spec.gate)
        return cls(
            spec.q,
            spec.k,
            spec.v,
            bias,
            bias_index,
            gate,
            gate_index,
            spec.attn_mask,
            spec.key_padding_mask,
            spec.document_ids,
            spec.dropout_seed,
            bias_kind,
            gate_kind,
            spec.is_causal,
            spec.normalization,
            spec.scale,
            spec.dropout_p,
            int(block_q),
            int(block_k),
        )

    def kind(self, term: str) -> str:
        """The kind of "bias" or "gate"."""
        return self.bias_kind if term == "bias" else self.gate_kind

    def to_spec(self) -> AttentionSpec:
        """The resolved call these arguments stand for (inside an op's body: one batch dim)."""
        return AttentionSpec(
            self.q,
            self.k,
            self.v,
            self.term("bias"),
            self.term("gate"),
            self.attn_mask,
            self.key_padding_mask,
            self.is_causal,
            self.normalization,
            self.scale,
            self.dropout_p,
            self.dropout_seed,
            (self.q.shape[0],),
            self.document_ids,
        )

    def term(self, role: str) -> Term | None:
        """The "bias" or "gate" as a `Term`."""
        if role == "bias":
            return term_of(self.bias, self.bias_index, self.bias_kind)
        return term_of(self.gate, self.gate_index, self.gate_kind)

    @property
    def tensors(self) -> tuple:
        return self[:N_TENSORS]

    @property
    def scalars(self) -> tuple:
        return self[N_TENSORS:]


N_TENSORS = ForwardArgs._fields.index("bias_kind")  # the tensors come first, then the scalars
GRADIENT_INPUTS = ("q", "k", "v", "bias", "gate", "attn_mask")  # what the backward returns for


class BackwardArgs(NamedTuple):
    """The backward op's arguments: the forward's outputs and incoming gradient, the forward's
    arguments unchanged, and which term gradients are wanted (the others come back empty)."""

    grad_out: Tensor  # (B, H, Lq, Dv)
    out: Tensor  # the forward's output
    stat: Tensor  # the forward's row statistic
    forward: ForwardArgs
    needs_bias: bool
    needs_gate: bool
    needs_mask: bool

    @classmethod
    def from_flat(cls, args: tuple) -> BackwardArgs:
        n = 3 + len(ForwardArgs._fields)
        return cls(*args[:3], ForwardArgs(*args[3:n]), *args[n:])

    def flat(self) -> tuple:
        return (*self[:3], *self.forward, *self[4:])

    @property
    def needs(self) -> tuple[bool, bool, bool]:
        return self.needs_bias, self.needs_gate, self.needs_mask


def _schema_type(hint) -> str:
    if hint is Tensor:
        return "Tensor"
    if typing.get_args(hint) and set(typing.get_args(hint)) == {Tensor, type(None)}:
        return "Tensor?"
    return {str: "str", bool: "bool", float: "float", int: "int"}[hint]


def _arguments(fields: type) -> list[str]:
    hints = typing.get_type_hints(fields)
    return [f"{_schema_type(hints[name])} {name}" for name in fields._fields]


FORWARD_SCHEMA = f"({', '.join(_arguments(ForwardArgs))}) -> (Tensor, Tensor)"
_needs = [f"bool {name}" for name in BackwardArgs._fields[4:]]
_head = [f"Tensor {name}" for name in BackwardArgs._fields[:3]]
BACKWARD_SCHEMA = (
    f"({', '.join([*_head, *_arguments(ForwardArgs), *_needs])}) -> "
    "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"
)
