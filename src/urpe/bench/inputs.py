"""The tensors every benchmark row reads: q, k, v and URPE's two Toeplitz tables."""

from __future__ import annotations

import torch

from ..kernels import Toeplitz
from ..kernels.terms import relative_offsets


def make_inputs(
    batch: int, heads: int, length: int, head_dim: int, dtype: torch.dtype, device="cpu", seed=0
) -> dict[str, torch.Tensor]:
    """q, k, v (B, H, L, D) in `dtype`; the tables (H, 2L-1) in float32 with the paper's
    initialisation (B ~ N(0, 0.02), C near 1). Every tensor is a leaf that requires grad."""
    gen = torch.Generator(device=device).manual_seed(seed)
    shape = (batch, heads, length, head_dim)
    q, k, v = (torch.randn(shape, generator=gen, device=device).to(dtype) for _ in range(3))
    width = 2 * length - 1
    table_b = 0.02 * torch.randn(heads, width, generator=gen, device=device)
    table_c = 1 + 0.1 * torch.randn(heads, width, generator=gen, device=device)
    tensors = dict(q=q, k=k, v=v, table_b=table_b, table_c=table_c)
    return {name: t.requires_grad_() for name, t in tensors.items()}


def dense_bias(inputs: dict[str, torch.Tensor], causal: bool = False) -> torch.Tensor:
    """The Toeplitz bias written out as a (B, H, L, L) leaf of its own (what SDPA needs to take
    it), the causal mask folded in as -inf."""
    q = inputs["q"]
    length = q.shape[-2]
    with torch.no_grad():
        dense = Toeplitz(inputs["table_b"]).dense(length, length).to(q.dtype)  # (1, H, L, L)
        if causal:
            dense = dense.masked_fill(relative_offsets(length, length, q.device) > 0, -torch.inf)
        dense = dense.expand(q.shape[0], -1, -1, -1).contiguous()
    return dense.requires_grad_()
