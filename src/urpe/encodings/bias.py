"""Encodings that only add a term to the logits, before normalisation.

Under softmax none of these can tell identical tokens apart (rows of the attention matrix sum
to 1, so identical values give identical outputs): they are the paper's "RPE" family. Each
returns a `Toeplitz` table (or, for FIRE, a dense tensor) so fused kernels can read it per tile.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..kernels import PositionTerm, Toeplitz, query_positions
from .base import RelativeEncoding
from .buckets import t5_buckets


def all_offsets(lq: int, lk: int, device=None) -> Tensor:
    """Every offset j - pos(i) possible for Lq queries over Lk keys: -K..K, shape (2K+1,)."""
    k = max(lq, lk) - 1
    return torch.arange(-k, k + 1, device=device)


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

    def bias(self, q: Tensor, lk: int, scale: float) -> PositionTerm:
        return Toeplitz(self.table)


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

    def bias(self, q: Tensor, lk: int, scale: float) -> PositionTerm:
        offsets = all_offsets(q.shape[-2], lk, q.device)
        buckets = t5_buckets(offsets, self.num_buckets, self.max_distance, self.bidirectional)
        return Toeplitz(self.table[:, buckets])  # (H, 2K+1)


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


class ALiBi(RelativeEncoding):
    """ALiBi: a fixed linear penalty b_ij = -m_h |j - i| (no parameters)."""

    def __init__(self, num_heads: int):
        super().__init__()
        self.register_buffer("slopes", alibi_slopes(num_heads), persistent=False)

    def bias(self, q: Tensor, lk: int, scale: float) -> PositionTerm:
        distance = all_offsets(q.shape[-2], lk, q.device).abs().to(self.slopes.dtype)
        return Toeplitz((-self.slopes[:, None] * distance).to(q.dtype))  # (H, 2K+1)


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

    def bias(self, q: Tensor, lk: int, scale: float) -> PositionTerm:
        r1, r2 = self._params()
        distance = all_offsets(q.shape[-2], lk, q.device).abs().to(r1.dtype)
        if self.kind == "log":
            table = -r1 * torch.log1p(r2 * distance)
        else:
            table = -r1 * distance.pow(r2)
        return Toeplitz(table.to(q.dtype))  # (H, 2K+1)


class FireBias(RelativeEncoding):
    """FIRE (Li et al. 2024): b_ij = f(psi(|i - j|) / psi(max(pos_i, L))), psi(x) = log(c x + 1).

    f is a small MLP to one value per head; c and the threshold L are learned. The normalisation by
    the query position is what lets FIRE interpolate to longer inputs. A second input, the side of
    the key (before or after the query), makes it usable without a causal mask. Not Toeplitz: the
    term depends on the query position, so it is returned dense, (1, H, Lq, Lk).
    """

    def __init__(self, num_heads: int, hidden: int = 32, init_threshold: float = 512.0):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(2, hidden), nn.ReLU(), nn.Linear(hidden, num_heads))
        self.log_c = nn.Parameter(torch.zeros(()))
        self.threshold = nn.Parameter(torch.tensor(init_threshold))

    def bias(self, q: Tensor, lk: int, scale: float) -> PositionTerm:
        lq = q.shape[-2]
        dtype = self.mlp[0].weight.dtype
        qpos = query_positions(lq, lk, q.device).to(dtype)  # (Lq,)
        offsets = torch.arange(lk, device=q.device).to(dtype)[None, :] - qpos[:, None]
        c = self.log_c.exp()

        def psi(x: Tensor) -> Tensor:
            return torch.log1p(c * x)

        scale_by = psi(torch.maximum(qpos, self.threshold.abs()))[:, None]  # (Lq, 1)
        features = torch.stack([psi(offsets.abs()) / scale_by, (offsets > 0).to(dtype)], -1)
        return self.mlp(features).permute(2, 0, 1).unsqueeze(0).to(q.dtype)  # (1, H, Lq, Lk)
