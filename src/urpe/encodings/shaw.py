"""Shaw et al. (2018): relative embeddings on the key side and on the value side.

    s_ij = scale * q_i . (k_j + aK[d_ij])        out_i = sum_j a_ij (v_j + aV[d_ij])

d_ij = clip(j - i, -K, K). The value-side term moves outputs by position even when every value
is the same, so Shaw passes the identical-tokens probe where bias-only encodings cannot.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..kernels import reference_weights, relative_offsets
from ..kernels.validation import check_attention_inputs
from .base import RelativeEncoding


class ShawRelative(RelativeEncoding):
    """Relative key (and optionally value) embeddings, shared across heads as in the paper.

    The value-side term needs the attention weights themselves, so this encoding always runs
    the reference (materialising) kernel.
    """

    def __init__(self, head_dim: int, max_distance: int, values: bool = True, init_std=0.02):
        super().__init__()
        self.max_distance = max_distance
        self.keys = nn.Parameter(torch.randn(2 * max_distance + 1, head_dim) * init_std)
        self.values = (
            nn.Parameter(torch.randn(2 * max_distance + 1, head_dim) * init_std) if values else None
        )

    def _index(self, lq: int, lk: int, device) -> Tensor:
        k = self.max_distance
        return relative_offsets(lq, lk, device).clamp(-k, k) + k  # (Lq, Lk)

    def bias(self, q: Tensor, lk: int, scale: float) -> Tensor:
        b, h, lq, _ = q.shape
        index = self._index(lq, lk, q.device)
        per_offset = q @ self.keys.to(q.dtype).T  # (B, H, Lq, 2K+1)
        return scale * per_offset.gather(-1, index.expand(b, h, lq, lk))  # (B, H, Lq, Lk)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, *, scale: float, **kwargs) -> Tensor:
        kwargs.pop("backend", None)
        check_attention_inputs(
            q, k, v, None, kwargs.get("gate"), kwargs.get("key_padding_mask"),
            kwargs.get("normalization", "softmax"), kwargs.get("dropout_p", 0.0),
        )  # fmt: skip
        lk = k.shape[-2]
        weights = reference_weights(q, k, bias=self.bias(q, lk, scale), scale=scale, **kwargs)
        out = weights @ v.to(weights.dtype)  # (B, H, Lq, Dv)
        if self.values is not None:
            b, h, lq, _ = weights.shape
            index = self._index(lq, lk, q.device).expand(b, h, lq, lk)
            # Sum the weights that fall on each clipped offset, then mix the value embeddings.
            per_offset = weights.new_zeros(b, h, lq, self.values.shape[0])
            per_offset = per_offset.scatter_add(-1, index, weights)  # (B, H, Lq, 2K+1)
            out = out + per_offset @ self.values.to(weights.dtype)
        return out.to(q.dtype)
