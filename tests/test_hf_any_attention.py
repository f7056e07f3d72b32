"""URPE in any PyTorch attention: the README's three-line recipe in a user's own module."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import urpe


class MyAttention(nn.Module):
    """A user's causal self-attention with a URPE gate (the recipe's three lines are marked)."""

    def __init__(self, dim: int = 32, heads: int = 4, max_distance: int = 16):
        super().__init__()
        self.heads = heads
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.gate = urpe.ToeplitzGate(heads, max_distance)  # 1. a gate, ones at init

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        b, length, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return tuple(t.view(b, length, self.heads, -1).transpose(1, 2) for t in (q, k, v))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.split(x)  # (B, H, L, D)
        positions = urpe.Positions.sequence(x.shape[1], device=x.device)  # 2. where tokens sit
        y = urpe.attention(q, k, v, is_causal=True, gate=self.gate(positions))  # 3. C after softmax
        return self.out(y.transpose(1, 2).flatten(2))


def test_recipe_equals_sdpa_at_init_and_gradients_reach_the_gate():
    module = MyAttention().double()
    x = torch.randn(2, 11, 32, dtype=torch.float64)
    q, k, v = module.split(x)
    expected = module.out(
        F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2)
    )
    got = module(x)
    assert (got - expected).abs().max() <= 1e-12
    got.square().sum().backward()
    assert module.gate.table.grad.abs().sum() > 0


def test_recipe_with_a_trained_gate_equals_softmax_times_c():
    module = MyAttention(max_distance=3).double()
    with torch.no_grad():
        module.gate.table.add_(torch.randn_like(module.gate.table))
    x = torch.randn(2, 11, 32, dtype=torch.float64)
    q, k, v = module.split(x)
    length = x.shape[1]
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    weights = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
    offsets = (torch.arange(length)[None, :] - torch.arange(length)[:, None]).clamp(-3, 3) + 3
    gate = module.gate.table[:, offsets]  # (H, L, L): c_ij = table[h, clip(j - i) + K]
    expected = module.out(((weights * gate) @ v).transpose(1, 2).flatten(2))
    assert (module(x) - expected).abs().max() <= 1e-12
