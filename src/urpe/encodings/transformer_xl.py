"""Transformer-XL relative attention (Dai et al. 2019).

    s_ij = scale * [ (q_i + u) . k_j  +  (q_i + v) . W_R r(i - j) ]

r(.) are sinusoids of the relative distance, W_R a learned projection, u and v learned per-head
vectors. The position term is a query-dependent bias, so any kernel that takes a dense bias runs it.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..kernels import attention, relative_offsets
from .absolute import sinusoid
from .base import RelativeEncoding
from .bias import all_offsets


class TransformerXLRelative(RelativeEncoding):
    def __init__(self, dim: int, num_heads: int, head_dim: int, init_std: float = 0.02):
        super().__init__()
        self.dim, self.num_heads, self.head_dim = dim, num_heads, head_dim
        self.project = nn.Linear(dim, num_heads * head_dim, bias=False)  # W_R
        self.content_bias = nn.Parameter(torch.randn(num_heads, 1, head_dim) * init_std)  # u
        self.position_bias = nn.Parameter(torch.randn(num_heads, 1, head_dim) * init_std)  # v

    def bias(self, q: Tensor, lk: int, scale: float) -> Tensor:
        b, h, lq, d = q.shape
        offsets = all_offsets(lq, lk, q.device)  # (2K+1,) values j - i
        r = self.project(sinusoid(-offsets, self.dim).to(self.project.weight.dtype))
        r = r.view(-1, h, d).transpose(0, 1).to(q.dtype)  # (H, 2K+1, D)
        per_offset = (q + self.position_bias.to(q.dtype)) @ r.transpose(-2, -1)  # (B,H,Lq,2K+1)
        index = relative_offsets(lq, lk, q.device) + (offsets.numel() - 1) // 2  # (Lq, Lk)
        return scale * per_offset.gather(-1, index.expand(b, h, lq, lk))  # (B, H, Lq, Lk)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, *, scale: float, **kwargs) -> Tensor:
        bias = self.bias(q, k.shape[-2], scale)
        q_content = q + self.content_bias.to(q.dtype)
        return attention(q_content, k, v, bias=bias, scale=scale, **kwargs)
