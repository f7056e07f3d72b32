"""Encodings that only add a term to the logits, before normalisation.

Under softmax none of these can tell identical tokens apart (rows of the attention matrix sum
to 1, so identical values give identical outputs): they are the paper's "RPE" family. On aligned
positions each returns a `Toeplitz` table (FIRE: a dense tensor) so fused kernels can read it per
tile; on arbitrary positions (per row, offset) an exact `Relation` or dense term.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..kernels import PositionTerm, Relation, Toeplitz
from .base import RelativeEncoding, clipped_table_term
from .buckets import t5_buckets
from .positions import Positions
from .registry import register_position


def all_offsets(lq: int, lk: int, device=None) -> Tensor:
    """Every offset j - pos(i) possible for Lq queries over Lk keys: -K..K, shape (2K+1,)."""
    k = max(lq, lk, 1) - 1
    return torch.arange(-k, k + 1, device=device)


def distances(positions: Positions) -> Tensor:
    """|key - query| as a (B or 1, 1, Lq, Lk) tensor, for terms that are a function of it."""
    return positions.offsets().abs()[:, None]


@register_position("rpe", lambda s: RelativeBias(s.num_heads, s.max_distance))
class RelativeBias(RelativeEncoding):
    """The paper's RPE ("unique" mode): one learned scalar per head per offset, b_ij = m(j - i).

    Offsets beyond max_distance reuse the edge entries (clipping), so any length works.
    Initialised N(0, init_std) as in the official code.
    """

    def __init__(self, num_heads: int, max_distance: int, init_std: float = 0.02):
        super().__init__()
        if max_distance < 0:
            raise ValueError(f"max_distance must be >= 0, got {max_distance}")
        self.table = nn.Parameter(torch.randn(num_heads, 2 * max_distance + 1) * init_std)

    def bias(self, q: Tensor, positions: Positions, scale: float) -> PositionTerm:
        return clipped_table_term(self.table, positions)


@register_position(
    "t5",
    lambda s: T5Bias(s.num_heads, s.num_buckets, s.bucket_max_distance, bidirectional=not s.causal),
)
class T5Bias(RelativeEncoding):
    """T5's relative bias: one learned scalar per head per log-spaced bucket of offsets."""

    def __init__(
        self,
        num_heads: int,
        num_buckets: int = 32,
        max_distance: int = 128,
        bidirectional: bool = True,
        init_std: float = 0.02,
    ):
        super().__init__()
        self.num_buckets, self.max_distance = num_buckets, max_distance
        self.bidirectional = bidirectional
        self.table = nn.Parameter(torch.randn(num_heads, num_buckets) * init_std)

    def bias(self, q: Tensor, positions: Positions, scale: float) -> PositionTerm:
        return bucketed_term(
            self.table, positions, self.num_buckets, self.max_distance, self.bidirectional
        )


def bucketed_term(
    table: Tensor, positions: Positions, num_buckets: int, max_distance: int, bidirectional: bool
) -> Toeplitz | Relation:
    """A per-head table over T5 buckets, (H, num_buckets), as a term at these positions."""
    if positions.is_aligned:
        offsets = all_offsets(positions.query_length, positions.key_length, table.device)
        buckets = t5_buckets(offsets, num_buckets, max_distance, bidirectional)
        return Toeplitz(table[:, buckets])  # (H, 2K+1)
    buckets = t5_buckets(positions.offsets(), num_buckets, max_distance, bidirectional)
    return Relation(table, buckets)  # index (B or 1, Lq, Lk)


def alibi_slopes(num_heads: int) -> Tensor:
    """Press et al.'s head slopes: a geometric sequence from 2^(-8/n); non-powers of two
    interleave the slopes of the next power of two, as in the ALiBi paper's code release."""

    def powers(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    if math.log2(num_heads).is_integer():
        return torch.tensor(powers(num_heads))
    lower = 2 ** math.floor(math.log2(num_heads))
    return torch.tensor(powers(lower) + powers(2 * lower)[0::2][: num_heads - lower])


@register_position("alibi", lambda s: ALiBi(s.num_heads))
class ALiBi(RelativeEncoding):
    """ALiBi: a fixed linear penalty b_ij = -m_h |j - i| (no parameters)."""

    def __init__(self, num_heads: int):
        super().__init__()
        self.register_buffer("slopes", alibi_slopes(num_heads), persistent=False)

    def bias(self, q: Tensor, positions: Positions, scale: float) -> PositionTerm:
        slopes = self.slopes
        if positions.is_aligned:
            lq, lk = positions.query_length, positions.key_length
            distance = all_offsets(lq, lk, q.device).abs().to(slopes.dtype)
            return Toeplitz((-slopes[:, None] * distance).to(q.dtype))  # (H, 2K+1)
        # Unbounded in the distance, so no finite table: dense (B or 1, H, Lq, Lk).
        return (-slopes[:, None, None] * distances(positions).to(slopes.dtype)).to(q.dtype)


@register_position("kerple-power", lambda s: KerpleBias(s.num_heads, "power"))
@register_position("kerple-log", lambda s: KerpleBias(s.num_heads, "log"))
class KerpleBias(RelativeEncoding):
    """KERPLE (Chi et al. 2022): conditionally positive definite kernels of the distance.

    kind="log":   b = -r1 * log(1 + r2 |j - i|)      r1, r2 > 0
    kind="power": b = -r1 * |j - i|^r2               r1 > 0, 0 < r2 <= 2
    """

    def __init__(self, num_heads: int, kind: str = "log", eps: float = 1e-2):
        super().__init__()
        if kind not in ("log", "power"):
            raise ValueError(f"kind must be 'log' or 'power', got {kind!r}")
        self.kind, self.eps = kind, eps
        # Raw parameters; constrained in `_params`. Initial r1 = 1, r2 = 1 (log) or 1 (power).
        self.raw_r1 = nn.Parameter(torch.full((num_heads,), math.log(math.e - 1)))
        self.raw_r2 = nn.Parameter(torch.zeros(num_heads))

    def _params(self) -> tuple[Tensor, Tensor]:
        r1 = F.softplus(self.raw_r1) + self.eps
        if self.kind == "log":
            r2 = F.softplus(self.raw_r2) + self.eps
        else:
            r2 = 2.0 * torch.sigmoid(self.raw_r2) + self.eps  # (0, 2]
        return r1[:, None], r2[:, None]

    def bias(self, q: Tensor, positions: Positions, scale: float) -> PositionTerm:
        r1, r2 = self._params()  # (H, 1) each
        if positions.is_aligned:
            lq, lk = positions.query_length, positions.key_length
            distance = all_offsets(lq, lk, q.device).abs().to(r1.dtype)  # (2K+1,)
        else:  # dense (B or 1, H, Lq, Lk): the kernel is unbounded in the distance
            distance = distances(positions).to(r1.dtype)
            r1, r2 = r1[..., None], r2[..., None]  # (H, 1, 1)
        if self.kind == "log":
            term = -r1 * torch.log1p(r2 * distance)
        else:
            term = -r1 * distance.pow(r2)
        return Toeplitz(term.to(q.dtype)) if positions.is_aligned else term.to(q.dtype)


@register_position("fire", lambda s: FireBias(s.num_heads, init_threshold=float(s.max_length)))
class FireBias(RelativeEncoding):
    """FIRE (Li et al. 2024): b_ij = f(psi(|i - j|) / psi(max(pos_i, L))), psi(x) = log(c x + 1).

    f is a small MLP to one value per head; c and the threshold L are learned. The normalisation by
    the query position is what lets FIRE interpolate to longer inputs. A second input, the side of
    the key (before or after the query), makes it usable without a causal mask. Not Toeplitz: the
    term depends on the query position (`Positions.query`, per row if given per row), so it is
    returned dense, (B or 1, H, Lq, Lk).
    """

    shift_invariant = False

    def __init__(self, num_heads: int, hidden: int = 32, init_threshold: float = 512.0):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(2, hidden), nn.ReLU(), nn.Linear(hidden, num_heads))
        self.log_c = nn.Parameter(torch.zeros(()))
        self.threshold = nn.Parameter(torch.tensor(init_threshold))

    def bias(self, q: Tensor, positions: Positions, scale: float) -> PositionTerm:
        dtype = self.mlp[0].weight.dtype
        query = positions.query if positions.query.dim() == 2 else positions.query[None]
        qpos = query.to(dtype)  # (B or 1, Lq)
        offsets = positions.offsets().to(dtype)  # (B or 1, Lq, Lk)
        c = self.log_c.exp()

        def psi(x: Tensor) -> Tensor:
            return torch.log1p(c * x)

        scale_by = psi(torch.maximum(qpos, self.threshold.abs()))[..., None]  # (B or 1, Lq, 1)
        features = torch.stack([psi(offsets.abs()) / scale_by, (offsets > 0).to(dtype)], -1)
        return self.mlp(features).permute(0, 3, 1, 2).to(q.dtype)  # (B or 1, H, Lq, Lk)
