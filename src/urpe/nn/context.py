"""The attention context: what every layer of one forward pass shares, built once by the model.

    context = AttentionContext(positions=Positions.graph(relation), key_padding_mask=padding,
                               bias=spatial_bias)          # once per forward pass
    for layer in layers:
        x = layer(x, context)                              # per layer: only what differs (past)

It carries where queries and keys sit (`Positions`), the masks, the causal flag and terms the
model computed itself (a bias or gate that replaces the modules' own, e.g. Graphormer's spatial
bias). Positions are shape-checked once per (Lq, Lk, B), not in every layer, and a term that
depends on positions alone (a Toeplitz table, FIRE's MLP, a relation gate) is computed once per
module, or once for all layers that tie their parameters (`term_key`, set by the builders).
A context holds terms of the parameters it saw: build a new one for every forward pass.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn

from ..encodings import Positions
from ..kernels import PositionTerm, attention

# The per-call keywords the modules took before the context; they still build one.
CONTEXT_KEYWORDS = (
    "key_padding_mask",
    "attn_mask",
    "is_causal",
    "positions",
    "bias",
    "gate",
    "document_ids",
)
PAST_KEYWORDS = ("cache", "memory")


@dataclass(eq=False)  # compared by identity: it holds tensors and a per-pass memo
class AttentionContext:
    """Shared by the attention layers of one forward pass.

    positions: where the queries and all keys (past keys included) sit; None: a plain sequence,
        `Positions.aligned(Lq, Lk)` (queries the last Lq of Lk keys).
    key_padding_mask: (B, L) bool, True = padded, for the keys of this call (past keys carry
        their own padding). attn_mask: SDPA's meaning, broadcastable to (B, H, Lq, Lk) over all
        keys. is_causal: query i sees keys j <= i + Lk - Lq.
    bias, gate: precomputed terms (tensor, `Toeplitz`, `Relation`) that replace the encoding's
        bias and the module's gate in every layer.
    document_ids: (B, L) integer ids of packed documents for the keys of this call (past keys
        carry their own, as padding): a query attends only to keys of its own document
        (`urpe.attention`'s document_ids); pair it with `Positions.from_document_ids`.
    calls: the attention function the layers call, with `urpe.attention`'s arguments: by
        default `urpe.attention` itself; a model passes its own `urpe.kernels.AttentionCalls`,
        which keeps the calls it prepared (checked, their backend chosen) from pass to pass.
    """

    positions: Positions | None = None
    key_padding_mask: Tensor | None = None
    attn_mask: Tensor | None = None
    is_causal: bool = False
    bias: PositionTerm | None = None
    gate: PositionTerm | None = None
    document_ids: Tensor | None = None
    calls: Callable[..., Tensor] = attention
    _checked: dict = field(default_factory=dict, init=False, repr=False)
    _terms: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.positions is not None and not isinstance(self.positions, Positions):
            raise TypeError(
                f"positions must be a urpe.Positions, got {type(self.positions).__name__}"
            )

    @classmethod
    def from_keywords(cls, **keywords: Any) -> tuple[AttentionContext, dict[str, Any]]:
        """The old per-call keywords as (context, {"cache": ..., "memory": ...})."""
        unknown = sorted(set(keywords) - {*CONTEXT_KEYWORDS, *PAST_KEYWORDS})
        if unknown:
            raise TypeError(f"unexpected keyword arguments: {', '.join(unknown)}")
        context = cls(**{k: keywords[k] for k in CONTEXT_KEYWORDS if k in keywords})
        return context, {k: keywords.get(k) for k in PAST_KEYWORDS}

    def positions_for(self, query_length: int, key_length: int, batch: int, device) -> Positions:
        """The positions of Lq queries over Lk keys, checked once per (Lq, Lk, B)."""
        shape = (query_length, key_length, batch)
        found = self._checked.get(shape)
        if found is None:
            if self.positions is None:
                found = Positions.aligned(query_length, key_length, device=device)
            else:
                self.positions.check_shape(query_length, key_length, batch, device=device)
                found = self.positions
            self._checked[shape] = found
        return found

    def term(
        self, kind: str, owner: nn.Module, positions: Positions, compute: Callable[[], Any], *key
    ) -> Any:
        """`compute()` once per (kind, owner, Lq, Lk, *key) in this context.

        Modules that tie their parameters share a `term_key` and so share the term (one FIRE MLP
        run, one gate lookup per forward pass, whatever the number of layers).
        """
        name = (
            kind,
            getattr(owner, "term_key", None) or id(owner),
            positions.query_length,
            positions.key_length,
            *key,
        )
        if name not in self._terms:
            self._terms[name] = compute()
        return self._terms[name]
