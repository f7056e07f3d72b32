"""Token mixers from Yun et al. (2020) that can stand in for self-attention in chosen layers.

Both compute a contextual mapping without attention and both see position directly: the
bilinear mixer through its (n x n) matrix, the convolution through its kernel taps.
They take attention's call, `mixer(x, context, past=None)`, so a layer does not care which it
holds; each is declared under its config name in `MIXER_REGISTRY` beside its class.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .context import AttentionContext
from .past import KVCache


@dataclass(frozen=True)
class MixerSettings:
    """What a mixer builder may read: model width, the longest sequence, the conv kernel size."""

    dim: int
    max_length: int
    kernel_size: int = 3


@dataclass(frozen=True)
class RegisteredMixer:
    name: str
    cls: type
    build: Callable[[MixerSettings], nn.Module]


MIXER_REGISTRY: dict[str, RegisteredMixer] = {}
T = TypeVar("T", bound=type)


def register_mixer(name: str, build: Callable[[MixerSettings], nn.Module]) -> Callable[[T], T]:
    """Class decorator: declare a token mixer's config name (`TransformerConfig.mixers`)."""
    if not isinstance(name, str) or not name or name == "attention":
        raise ValueError(
            f"a mixer name must be a non-empty string other than 'attention': {name!r}"
        )

    def decorate(cls: T) -> T:
        MIXER_REGISTRY[name] = RegisteredMixer(name, cls, build)
        return cls

    return decorate


register_mixer.registry = MIXER_REGISTRY  # for `urpe.encodings.registered`


def _prepare(
    name: str,
    context: AttentionContext | None,
    past: KVCache | None,
    keywords: dict,
    from_zero: bool,
) -> AttentionContext:
    """The context of a mixer call; refuses what a mixer, which works by index over the current
    input only, would ignore."""
    if keywords:
        if context is not None:
            raise TypeError("give an AttentionContext or per-call keywords, not both")
        context, pasts = AttentionContext.from_keywords(**keywords)
        past = past if pasts["cache"] is None else pasts["cache"]
        if pasts["memory"] is not None:
            raise NotImplementedError(f"{name} does not take memory")
    context = context if context is not None else AttentionContext()
    if past is not None:
        raise NotImplementedError(f"{name} does not support incremental decoding")
    for what in ("attn_mask", "bias", "gate", "document_ids"):
        if getattr(context, what) is not None:
            raise NotImplementedError(f"{name} does not take {what}")
    positions = context.positions
    if positions is not None and not (
        positions.is_aligned
        and positions.documents is None
        and positions.query_length == positions.key_length
        and (positions.query_start == 0 or not from_zero)
    ):
        raise NotImplementedError(
            f"{name} mixes tokens by index; it cannot take {positions} "
            "(only a plain sequence" + (" starting at position 0)" if from_zero else ")")
        )
    return context


def _zero_padding(x: Tensor, key_padding_mask: Tensor | None) -> Tensor:
    return x if key_padding_mask is None else x.masked_fill(key_padding_mask[..., None], 0.0)


@register_mixer("bilinear", lambda s: BilinearMixer(s.dim, s.max_length))
class BilinearMixer(nn.Module):
    """X -> P X W: a learned (n x n) matrix P mixes positions, a linear map W mixes features.

    n = max_len; shorter inputs use the leading block of P. Causal use keeps P lower-triangular.
    """

    def __init__(self, dim: int, max_len: int):
        super().__init__()
        self.max_len = max_len
        self.positions = nn.Parameter(torch.eye(max_len) + torch.randn(max_len, max_len) * 0.02)
        self.features = nn.Linear(dim, dim)

    def forward(
        self,
        x: Tensor,
        context: AttentionContext | None = None,
        *,
        past: KVCache | None = None,
        **keywords,
    ) -> Tensor:
        """x (B, L, E) -> (B, L, E); reads the context's padding and causal flag."""
        context = _prepare("BilinearMixer", context, past, keywords, from_zero=True)
        length = x.shape[1]
        if length > self.max_len:
            raise ValueError(f"BilinearMixer was built for max_len={self.max_len}, got {length}")
        p = self.positions[:length, :length]  # (L, L)
        if context.is_causal:
            p = p.tril()
        # Padded positions are zeroed after the feature map (its bias would leak otherwise).
        return p.to(x.dtype) @ _zero_padding(self.features(x), context.key_padding_mask)


@register_mixer("conv", lambda s: SeparableConvMixer(s.dim, s.kernel_size))
class SeparableConvMixer(nn.Module):
    """Depth-wise convolution over positions, then a point-wise linear map."""

    def __init__(self, dim: int, kernel_size: int = 3):
        super().__init__()
        self.kernel_size = kernel_size
        self.depthwise = nn.Conv1d(dim, dim, kernel_size, groups=dim)
        self.pointwise = nn.Linear(dim, dim)

    def forward(
        self,
        x: Tensor,
        context: AttentionContext | None = None,
        *,
        past: KVCache | None = None,
        **keywords,
    ) -> Tensor:
        """x (B, L, E) -> (B, L, E); reads the context's padding and causal flag."""
        context = _prepare("SeparableConvMixer", context, past, keywords, from_zero=False)
        h = _zero_padding(x, context.key_padding_mask).transpose(1, 2)  # (B, E, L)
        left = self.kernel_size - 1 if context.is_causal else (self.kernel_size - 1) // 2
        h = F.pad(h, (left, self.kernel_size - 1 - left))  # zero padding keeps length L
        return self.pointwise(self.depthwise(h).transpose(1, 2))  # (B, L, E)
