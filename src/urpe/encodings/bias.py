"""Encodings that only add a term to the logits, before normalisation.

Under softmax none of these can tell identical tokens apart (rows of the attention matrix sum
to 1, so identical values give identical outputs): they are the paper's "RPE" family. On aligned
positions each returns a `Toeplitz` table (FIRE: a dense tensor) so tiled kernels can read it per
tile; on arbitrary positions (per row, offset) an exact `Relation` or dense term.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..kernels import PositionTerm, Relation, Toeplitz
from .base import RelativeEncoding, clipped_table_term, shifted_offsets
from .buckets import BUCKET_OPTIONS, t5_buckets
from .positions import Positions
from .registry import register_position


def all_offsets(lq: int, lk: int, device=None) -> Tensor:
    """Every offset j - pos(i) possible for Lq queries over Lk keys: -K..K, shape (2K+1,)."""
    k = max(lq, lk, 1) - 1
    return torch.arange(-k, k + 1, device=device)


def distances(positions: Positions) -> Tensor:
    """|key - query| as a (B or 1, 1, Lq, Lk) tensor, for terms that are a function of it."""
    return positions.offsets().abs()[:, None]


@register_position("rpe", lambda s: RelativeBias(s.num_heads, s.max_distance), uses_order=True)
class RelativeBias(RelativeEncoding):
    """The paper's RPE ("unique" mode): one learned scalar per head per offset, b_ij = m(j - i).

    Offsets beyond max_distance reuse the edge entries (clipping), so any length works.
    Initialised N(0, init_std) as in the official code.
    """

    query_independent = True

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
    uses_order=True,
    options=BUCKET_OPTIONS,
)
class T5Bias(RelativeEncoding):
    """T5's relative bias: one learned scalar per head per log-spaced bucket of offsets."""

    query_independent = True

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
    shift = positions.toeplitz_shift
    if positions.is_aligned or shift is not None:
        if shift is None:
            offsets = all_offsets(*positions.table_lengths, table.device)
        else:  # contiguous positions (a static KV cache): the offsets shifted, still Toeplitz
            offsets = shifted_offsets(positions, shift)
        buckets = t5_buckets(offsets, num_buckets, max_distance, bidirectional)
        return Toeplitz(table[:, buckets])  # (H, 2K+1)
    buckets = t5_buckets(positions.offsets(), num_buckets, max_distance, bidirectional)
    return Relation(table, buckets, in_range=True)  # index (B or 1, Lq, Lk), in range


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


@register_position("alibi", lambda s: ALiBi(s.num_heads), uses_order=True)
class ALiBi(RelativeEncoding):
    """ALiBi: a fixed linear penalty b_ij = -m_h |j - i| (no parameters)."""

    query_independent = True

    def __init__(self, num_heads: int):
        super().__init__()
        self.register_buffer("slopes", alibi_slopes(num_heads), persistent=False)

    def bias(self, q: Tensor, positions: Positions, scale: float) -> PositionTerm:
        slopes = self.slopes
        if positions.is_aligned:
            distance = all_offsets(*positions.table_lengths, q.device).abs().to(slopes.dtype)
            return Toeplitz((-slopes[:, None] * distance).to(q.dtype))  # (H, 2K+1)
        # Unbounded in the distance, so no finite table: dense (B or 1, H, Lq, Lk).
        return (-slopes[:, None, None] * distances(positions).to(slopes.dtype)).to(q.dtype)


@register_position("kerple-power", lambda s: KerpleBias(s.num_heads, "power"), uses_order=True)
@register_position("kerple-log", lambda s: KerpleBias(s.num_heads, "log"), uses_order=True)
class KerpleBias(RelativeEncoding):
    """KERPLE (Chi et al. 2022): conditionally positive definite kernels of the distance.

    kind="log":   b = -r1 * log(1 + r2 |j - i|)      r1, r2 > eps
    kind="power": b = -r1 * |j - i|^r2               r1 > eps, eps < r2 <= 2

    Parameterisation (the official code instead clamps plain parameters in place each step):
        r = eps + softplus(raw)                      every positive parameter
        r2 = 2 - (2 - eps) * sigmoid(-raw_r2)        the power kernel's exponent
    so the constraints hold at every step, gradients never vanish at a bound, and r2 <= 2
    exactly in any float format (above 2 the kernel is no longer conditionally positive
    definite, which is what KERPLE's guarantee rests on). r2 = 2 itself needs raw = +inf; the
    converter in `urpe.encodings.porting` maps an official exponent of 2 to a raw value whose r2
    rounds to 2.

    Initialisation, as the official code: random per head, log: r1 ~ U(0, 2), r2 ~ U(0, 1);
    power: r1 ~ U(0, 1), r2 ~ U(0, 2). Draws closer than `eps` to a bound are moved to `eps`
    from it (the official code clamps them onto the bound, where a raw parameter would sit at
    infinity). Different heads thus start with different decay rates, as ALiBi's slopes do.
    """

    query_independent = True

    def __init__(self, num_heads: int, kind: str = "log", eps: float = 1e-2):
        super().__init__()
        if kind not in ("log", "power"):
            raise ValueError(f"kind must be 'log' or 'power', got {kind!r}")
        if not 0 < eps < 1:
            raise ValueError(f"eps must be in (0, 1), got {eps}")
        self.kind, self.eps = kind, eps
        scale_r1, scale_r2 = (2.0, 1.0) if kind == "log" else (1.0, 2.0)
        r1 = torch.rand(num_heads, dtype=torch.float64) * scale_r1
        r2 = torch.rand(num_heads, dtype=torch.float64) * scale_r2
        upper = 2.0 - 2 * eps if kind == "power" else math.inf
        self.raw_r1 = nn.Parameter(self.raw_from(r1.clamp_min(2 * eps), "r1").float())
        self.raw_r2 = nn.Parameter(self.raw_from(r2.clamp(2 * eps, upper), "r2").float())

    def raw_from(self, value: Tensor, name: str, tiny: float = 1e-14) -> Tensor:
        """The raw parameter that gives `value` for r1 or r2 (inverse of `_params`).

        Values at (or past) a bound are first clamped onto it, as the official code does, then
        moved about `tiny` inside it so the raw value is finite; computed in float64.
        """
        value = value.double().clamp_min(self.eps)
        if name == "r2" and self.kind == "power":
            value = value.clamp_max(2.0)
            below_two = ((2.0 - value) / (2.0 - self.eps)).clamp(tiny, 1.0 - tiny)  # sigmoid(-raw)
            return -torch.logit(below_two)
        excess = (value - self.eps).clamp_min(tiny)  # softplus(raw)
        return excess + torch.log(-torch.expm1(-excess))  # softplus^-1, stable for large values

    def _params(self) -> tuple[Tensor, Tensor]:
        r1 = F.softplus(self.raw_r1) + self.eps
        if self.kind == "log":
            r2 = F.softplus(self.raw_r2) + self.eps
        else:
            r2 = 2.0 - (2.0 - self.eps) * torch.sigmoid(-self.raw_r2)  # (eps, 2]
        return r1[:, None], r2[:, None]

    def bias(self, q: Tensor, positions: Positions, scale: float) -> PositionTerm:
        r1, r2 = self._params()  # (H, 1) each
        if positions.is_aligned:
            distance = all_offsets(*positions.table_lengths, q.device).abs().to(r1.dtype)
        else:  # dense (B or 1, H, Lq, Lk): the kernel is unbounded in the distance
            distance = distances(positions).to(r1.dtype)
            r1, r2 = r1[..., None], r2[..., None]  # (H, 1, 1)
        if self.kind == "log":
            term = -r1 * torch.log1p(r2 * distance)
        else:
            term = -r1 * distance.pow(r2)
        return Toeplitz(term.to(q.dtype)) if positions.is_aligned else term.to(q.dtype)


@register_position(
    "fire", lambda s: FireBias(s.num_heads, init_threshold=float(s.max_length)), uses_order=True
)
class FireBias(RelativeEncoding):
    """FIRE (Li et al. 2024): a learned function of the distance, normalised by the query position.

        b_ij = f(psi(|i - j|) / (psi(max(pos_i, L)) + eps)),      psi(x) = log(c x + 1)

    f is a small MLP to one value per head; c and the threshold L are learned. The normalisation by
    the query position is what lets FIRE interpolate to longer inputs; eps (the paper's 1e-6) keeps
    the ratio finite when L reaches 0 at the query in position 0. A second input, the side of
    the key (before or after the query), makes it usable without a causal mask. Not Toeplitz: the
    term depends on the query position (`Positions.query`, per row if given per row), so it is
    returned dense, (B or 1, H, Lq, Lk).

    Parameters and initialisation against the paper's code: c is stored as log c (the paper
    stores c and uses |c|), initialised to the paper's 0.1; the threshold L is learned directly,
    initialised to `init_threshold` (the paper learns a multiplier of a fixed L0 = 512, so under
    Adam its L moves L0 times faster); the MLP is the paper's (hidden 32, ReLU) with the extra
    side input, which a causal model never sees set. `urpe.encodings.porting.fire_from_paper`
    converts the paper's parameters.
    """

    query_independent = True
    shift_invariant = False

    def __init__(
        self,
        num_heads: int,
        hidden: int = 32,
        init_threshold: float = 512.0,
        init_c: float = 0.1,
        eps: float = 1e-6,
    ):
        super().__init__()
        if not init_c > 0:
            raise ValueError(f"init_c must be > 0, got {init_c}")
        self.eps = eps
        self.mlp = nn.Sequential(nn.Linear(2, hidden), nn.ReLU(), nn.Linear(hidden, num_heads))
        self.log_c = nn.Parameter(torch.tensor(math.log(init_c)))
        self.threshold = nn.Parameter(torch.tensor(float(init_threshold)))

    def bias(self, q: Tensor, positions: Positions, scale: float) -> PositionTerm:
        dtype = self.mlp[0].weight.dtype
        query = positions.query if positions.query.dim() == 2 else positions.query[None]
        qpos = query.to(dtype)  # (B or 1, Lq)
        offsets = positions.offsets().to(dtype)  # (B or 1, Lq, Lk)
        c = self.log_c.exp()

        def psi(x: Tensor) -> Tensor:
            return torch.log1p(c * x)

        normaliser = psi(torch.maximum(qpos, self.threshold.abs())) + self.eps  # (B or 1, Lq)
        distance = psi(offsets.abs()) / normaliser[..., None]  # (B or 1, Lq, Lk)
        # Packed documents give per-row query positions but shared offsets: broadcast the side.
        side = (offsets > 0).to(dtype).expand_as(distance)
        features = torch.stack([distance, side], -1)  # (B or 1, Lq, Lk, 2)
        return self.mlp(features).permute(0, 3, 1, 2).to(q.dtype)  # (B or 1, H, Lq, Lk)
