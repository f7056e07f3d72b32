"""A bias indexed by a pairwise relation: Graphormer's spatial encoding, b_ij = table[h, r_ij].

The relation comes with the data (`Positions.relation`, e.g. shortest-path distances computed
once per graph), not from sequence offsets. Together with `RelationGate` it is URPE on graphs.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..kernels import Relation
from .base import RelativeEncoding
from .positions import Positions
from .registry import register_position


@register_position(
    "relation", lambda s: RelationBias(s.num_heads, s.num_relations), uses_relation=True
)
class RelationBias(RelativeEncoding):
    """One learned scalar per head per relation value, initialised N(0, init_std).

    Args:
        num_heads: H. num_relations: R; `positions.relation` must hold indices in [0, R).
    """

    query_independent = True

    def __init__(self, num_heads: int, num_relations: int, init_std: float = 0.02):
        super().__init__()
        if num_relations < 1:
            raise ValueError(f"num_relations must be >= 1, got {num_relations}")
        self.num_relations = num_relations
        self.table = nn.Parameter(torch.randn(num_heads, num_relations) * init_std)

    def bias(self, q: Tensor, positions: Positions, scale: float) -> Relation:
        positions.check_relation_range(self.num_relations, "RelationBias")
        return self.term(positions.relation, in_range=True)  # checked once per positions

    def term(self, relation: Tensor, in_range: bool = False) -> Relation:
        """The bias for a relation index (B, Lq, Lk) as a structured term (kernels read it tile
        by tile; `urpe.attention` checks the range unless `in_range`)."""
        return Relation(self.table, relation, in_range)
