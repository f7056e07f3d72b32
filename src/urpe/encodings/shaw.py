"""Shaw et al. (2018): relative embeddings on the key side and on the value side.

    s_ij = scale * q_i . (k_j + aK[d_ij])        out_i = sum_j a_ij (v_j + aV[d_ij])

d_ij = clip(j - i, -K, K). The value-side term moves outputs by position even when every value
is the same, so Shaw passes the identical-tokens probe where bias-only encodings cannot.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..kernels import choose_backend, reference_weights, resolve
from .base import RelativeEncoding, refuse_precomputed_bias
from .positions import Positions
from .registry import register_position


@register_position("shaw", lambda s: ShawRelative(s.head_dim, s.max_distance), uses_order=True)
class ShawRelative(RelativeEncoding):
    """Relative key (and optionally value) embeddings, shared across heads as in the paper.

    The value-side term needs the attention weights themselves, so this encoding runs the
    reference (materialising) kernel: backend "auto" or "reference"; another registered name
    is refused with the reason, an unknown one as `urpe.attention` refuses it.
    """

    value_side = True

    def __init__(self, head_dim: int, max_distance: int, values: bool = True, init_std=0.02):
        super().__init__()
        if max_distance < 0:
            raise ValueError(f"max_distance must be >= 0, got {max_distance}")
        self.max_distance = max_distance
        self.keys = nn.Parameter(torch.randn(2 * max_distance + 1, head_dim) * init_std)
        self.values = (
            nn.Parameter(torch.randn(2 * max_distance + 1, head_dim) * init_std) if values else None
        )

    def _index(self, positions: Positions) -> Tensor:
        k = self.max_distance
        return positions.offsets().clamp(-k, k) + k  # (B or 1, Lq, Lk)

    def bias(self, q: Tensor, positions: Positions, scale: float) -> Tensor:
        b, h, lq, _ = q.shape
        index = self._index(positions)[:, None].expand(b, h, lq, positions.key_length)
        per_offset = q @ self.keys.to(q.dtype).T  # (B, H, Lq, 2K+1)
        return scale * per_offset.gather(-1, index)  # (B, H, Lq, Lk)

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, *, positions: Positions, scale: float, **kwargs
    ) -> Tensor:
        refuse_precomputed_bias(self, kwargs.pop("bias", None))
        _check_backend(kwargs.pop("backend", "auto"), q, k, v, kwargs)
        if k.shape[-2] == 0:  # no keys: every row sees nothing and is 0, as in urpe.attention
            return q.new_zeros(*q.shape[:-1], v.shape[-1])
        resolve(q, k, v, **kwargs)  # every argument checked, one clear error
        bias = self.bias(q, positions, scale)  # (B, H, Lq, Lk)
        weights = reference_weights(q, k, bias=bias, scale=scale, **kwargs)
        out = weights @ v.to(weights.dtype)  # (B, H, Lq, Dv)
        if self.values is not None:
            b, h, lq, lk = weights.shape
            index = self._index(positions)[:, None].expand(b, h, lq, lk)
            # Sum the weights that fall on each clipped offset, then mix the value embeddings.
            per_offset = weights.new_zeros(b, h, lq, self.values.shape[0])
            per_offset = per_offset.scatter_add(-1, index, weights)  # (B, H, Lq, 2K+1)
            out = out + per_offset @ self.values.to(weights.dtype)
        return out.to(q.dtype)


def _check_backend(backend: str, q: Tensor, k: Tensor, v: Tensor, kwargs: dict) -> None:
    """ValueError unless `backend` is "auto" or "reference" (through dispatch, so an unknown or
    unsuitable name gets dispatch's own message)."""
    if backend == "auto":
        return
    call = {
        name: kwargs[name]
        for name in (
            "attn_mask",
            "is_causal",
            "key_padding_mask",
            "gate",
            "normalization",
            "dropout_p",
            "document_ids",
        )
        if name in kwargs
    }
    chosen = choose_backend(backend, resolve(q, k, v, **call))
    if chosen.name != "reference":
        raise ValueError(
            f"ShawRelative needs the attention weights for its value-side term and runs on the "
            f"reference kernel only: backend must be 'auto' or 'reference', got {backend!r}"
        )
