"""Transformer-XL relative attention (Dai et al. 2019).

    s_ij = scale * [ (q_i + u) . k_j  +  (q_i + v) . W_R r(i - j) ]

r(.) are sinusoids of the relative distance, W_R a learned projection, u and v learned per-head
vectors. The position term is a query-dependent bias, so any kernel that takes a dense bias runs it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from ..kernels import attention
from .absolute import sinusoid, sinusoid_frequencies
from .base import RelativeEncoding, refuse_precomputed_bias
from .bias import all_offsets
from .positions import Positions
from .registry import register_position


@register_position(
    "txl", lambda s: TransformerXLRelative(s.dim, s.num_heads, s.head_dim), uses_order=True
)
class TransformerXLRelative(RelativeEncoding):
    """Transformer-XL's relative attention: s_ij = scale * [(q_i + u) . k_j + (q_i + v) . W_R
    r(i - j)], per head (Dai et al. 2019; `position="txl"` in a config).

    Args:
        dim: the model width, the size of the sinusoids r(i - j) that W_R projects.
        num_heads: H; u, v and W_R's output are per head.
        head_dim: D, the size of q and k per head.
        init_std: standard deviation of the normal initialisation of u and v.

    Its position term depends on the query, so it reaches the kernel as a dense (B, H, Lq, Lk)
    bias (any backend that takes one runs it): built from the 2K + 1 offsets of aligned
    positions, or, for arbitrary `Positions` (a cache, packed rows), from the positions
    themselves without an (Lq, Lk, dim) tensor. Parameters: `project` (W_R, a linear map from
    dim to H * D, no bias), `content_bias` (u) and `position_bias` (v), each (H, 1, D).
    """

    def __init__(self, dim: int, num_heads: int, head_dim: int, init_std: float = 0.02):
        super().__init__()
        self.dim, self.num_heads, self.head_dim = dim, num_heads, head_dim
        self.project = nn.Linear(dim, num_heads * head_dim, bias=False)  # W_R
        self.content_bias = nn.Parameter(torch.randn(num_heads, 1, head_dim) * init_std)  # u
        self.position_bias = nn.Parameter(torch.randn(num_heads, 1, head_dim) * init_std)  # v

    def bias(self, q: Tensor, positions: Positions, scale: float) -> Tensor:
        if not positions.is_aligned:
            return scale * self._bias_at(q, positions)
        b, h, lq, d = q.shape
        lk = positions.key_length
        offsets = all_offsets(lq, lk, q.device)  # (2K+1,) values j - i
        r = self.project(sinusoid(-offsets, self.dim, dtype=self.project.weight.dtype))
        r = r.view(-1, h, d).transpose(0, 1).to(q.dtype)  # (H, 2K+1, D)
        per_offset = (q + self.position_bias.to(q.dtype)) @ r.transpose(-2, -1)  # (B,H,Lq,2K+1)
        k = (offsets.numel() - 1) // 2
        index = positions.offsets()[0] + k  # (Lq, Lk): offsets j - i, within -K..K when aligned
        return scale * per_offset.gather(-1, index.expand(b, h, lq, lk))  # (B, H, Lq, Lk)

    def _bias_at(self, q: Tensor, positions: Positions) -> Tensor:
        """(q_i + v) . W_R r(p_i - p_j) for arbitrary positions, without an (Lq, Lk, dim) tensor.

        With a = W_R^T (q + v) split into its sine and cosine halves (a_s, a_c), and
        r(p_i - p_j) = [sin w(p_i - p_j) | cos w(p_i - p_j)], the angle-difference identities
        give a_s.sin + a_c.cos = [a_s S_i + a_c C_i | a_c S_i - a_s C_i] . [C_j | S_j],
        S = sin(w p), C = cos(w p): a matrix product. Angles in float64 keep it exact to
        rounding for large positions.
        """
        b, h, lq, d = q.shape
        weight = self.project.weight.view(h, d, self.dim).to(q.dtype)  # (H, D, dim)
        a = (q + self.position_bias.to(q.dtype)) @ weight  # (B, H, Lq, dim)
        half = self.dim // 2
        a_sin, a_cos = a[..., :half], a[..., half : 2 * half]  # an odd dim's last channel is 0
        freq = sinusoid_frequencies(self.dim, q.device)  # (dim/2,) float64 where supported

        def angles(p: Tensor) -> tuple[Tensor, Tensor]:
            p = p if p.dim() == 2 else p[None]  # (B or 1, L)
            theta = p.to(freq.dtype)[..., None] * freq  # (B or 1, L, dim/2)
            return theta.sin().to(q.dtype)[:, None], theta.cos().to(q.dtype)[:, None]

        s_q, c_q = angles(positions.query)  # (B or 1, 1, Lq, dim/2)
        s_k, c_k = angles(positions.key)  # (B or 1, 1, Lk, dim/2)
        left = torch.cat([a_sin * s_q + a_cos * c_q, a_cos * s_q - a_sin * c_q], -1)
        right = torch.cat([c_k, s_k], -1)  # (B or 1, 1, Lk, dim)
        return left @ right.transpose(-2, -1)  # (B, H, Lq, Lk)

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        positions: Positions,
        scale: float,
        calls: Callable[..., Tensor] = attention,
        **kwargs,
    ) -> Tensor:
        refuse_precomputed_bias(self, kwargs.pop("bias", None))
        q_content = q + self.content_bias.to(q.dtype)
        bias = self.bias(q, positions, scale)
        return calls(q_content, k, v, bias=bias, scale=scale, **kwargs)
