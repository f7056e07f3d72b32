"""URPE's gate C: a learned matrix multiplied into the attention weights after the normalisation
(paper's Eq. 8). Rows of softmax(.) * C need not sum to 1, which is what restores universal
approximation. Initialised to ones, URPE starts out exactly equal to its RPE.

`ToeplitzGate` indexes C by the offset key - query (sequences); `RelationGate` by a pairwise
relation such as the shortest-path distance (URPE on graphs). Both are called with a `Positions`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..kernels import Relation, Toeplitz
from .base import clipped_table_term
from .bias import bucketed_term
from .buckets import BUCKET_OPTIONS
from .positions import Positions
from .registry import register_gate

ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "relu": F.relu,
    "softplus": F.softplus,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
    "abs": torch.abs,
}


def _initial_table(heads: int, width: int, init: str, mean: float, std: float) -> Tensor:
    if init == "ones":
        return torch.ones(heads, width)
    if init == "normal":
        return torch.randn(heads, width) * std + mean
    raise ValueError(f"init must be 'ones' or 'normal', got {init!r}")


def _activation(
    activation: str | Callable[[Tensor], Tensor] | None,
) -> Callable[[Tensor], Tensor] | None:
    if isinstance(activation, str):
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)} or a callable")
        return ACTIVATIONS[activation]
    if activation is not None and not callable(activation):
        raise TypeError(f"activation must be a name, a callable or None, got {activation!r}")
    return activation


# Every gate's own options (a spec sets them: {"name": "toeplitz", "init": "normal"}).
GATE_OPTIONS = {"init": "ones", "activation": None}


def _toeplitz_gate(s):
    # At least one offset either side: with K = 0 the gate would be one constant per head.
    return ToeplitzGate(s.num_heads, max(s.max_distance, 1), init=s.init, activation=s.activation)


def _bucketed_gate(s):
    return ToeplitzGate(
        s.num_heads,
        num_buckets=s.num_buckets,
        bucket_max_distance=s.bucket_max_distance,
        init=s.init,
        activation=s.activation,
    )


@register_gate("t5", _bucketed_gate, uses_order=True, options={**GATE_OPTIONS, **BUCKET_OPTIONS})
@register_gate("toeplitz", _toeplitz_gate, uses_order=True, options=GATE_OPTIONS)
class ToeplitzGate(nn.Module):
    """c_ij = act(table[h, offset(j - i)]), per head.

    Args:
        num_heads: heads H.
        max_distance: K for the "unique" mode: offsets -K..K each get an entry, farther ones
            reuse the edge entries (clipping). Must be >= 1.
        num_buckets: instead of max_distance, T5-style log buckets (up to
            `bucket_max_distance`) replace the per-offset entries ("urpe-t5").
        init: "ones" (the paper's constant init) or "normal" (N(init_mean, init_std)).
        activation: None (the paper: unconstrained) or a name in ACTIVATIONS, or a callable,
            applied to the table.

    One of max_distance and num_buckets is required: a gate with neither (or K = 0) would be one
    constant per head, which is not position-aware at all.
    """

    def __init__(
        self,
        num_heads: int,
        max_distance: int | None = None,
        *,
        num_buckets: int | None = None,
        bucket_max_distance: int = 128,
        init: str = "ones",
        init_mean: float = 0.0,
        init_std: float = 0.02,
        activation: str | Callable[[Tensor], Tensor] | None = None,
    ):
        super().__init__()
        if num_buckets is not None:
            if max_distance is not None:
                raise ValueError("give ToeplitzGate max_distance or num_buckets, not both")
            if num_buckets < 4 or num_buckets % 2:
                raise ValueError(
                    f"num_buckets must be even and >= 4 (half per direction), got {num_buckets}"
                )
            if bucket_max_distance < num_buckets // 2:
                raise ValueError(
                    f"bucket_max_distance must be >= num_buckets // 2 = {num_buckets // 2}, "
                    f"got {bucket_max_distance}"
                )
            width = num_buckets
        elif max_distance is None:
            raise ValueError(
                "ToeplitzGate needs max_distance (an entry per offset -K..K) or num_buckets "
                "(T5 buckets): without them it is one constant per head, not position-aware"
            )
        elif max_distance < 1:
            raise ValueError(
                f"ToeplitzGate max_distance must be >= 1, got {max_distance}: with K = 0 every "
                "offset shares one entry per head, which is not position-aware"
            )
        else:
            width = 2 * max_distance + 1
        self.table = nn.Parameter(_initial_table(num_heads, width, init, init_mean, init_std))
        self.num_buckets, self.bucket_max_distance = num_buckets, bucket_max_distance
        self.activation = _activation(activation)

    def forward(self, positions: Positions) -> Toeplitz | Relation:
        """The gate at these positions: a `Toeplitz` term when they are aligned, else the same
        lookup as an exact `Relation` over the offsets."""
        table = self.table if self.activation is None else self.activation(self.table)
        if self.num_buckets is not None:
            # The gate spends buckets on both directions even in a causal model (as before).
            return bucketed_term(table, positions, self.num_buckets, self.bucket_max_distance, True)
        return clipped_table_term(table, positions)


@register_gate(
    "relation",
    lambda s: RelationGate(s.num_heads, s.num_relations, init=s.init, activation=s.activation),
    uses_relation=True,
    options=GATE_OPTIONS,
)
class RelationGate(nn.Module):
    """URPE on graphs: c_ij = act(table[h, relation_ij]), C indexed by a pairwise relation.

    The relation is `positions.relation` (B, Lq, Lk), e.g. the shortest-path distance, with
    indices in [0, num_relations). Same init and activation options as `ToeplitzGate`; "ones"
    makes the model start out equal to the one without the gate.
    """

    def __init__(
        self,
        num_heads: int,
        num_relations: int,
        *,
        init: str = "ones",
        init_mean: float = 0.0,
        init_std: float = 0.02,
        activation: str | Callable[[Tensor], Tensor] | None = None,
    ):
        super().__init__()
        if num_relations < 1:
            raise ValueError(f"num_relations must be >= 1, got {num_relations}")
        self.num_relations = num_relations
        self.table = nn.Parameter(
            _initial_table(num_heads, num_relations, init, init_mean, init_std)
        )
        self.activation = _activation(activation)

    def forward(self, positions: Positions) -> Relation:
        positions.check_relation_range(self.num_relations, "RelationGate")
        table = self.table if self.activation is None else self.activation(self.table)
        return Relation(table, positions.relation, in_range=True)  # checked just above
