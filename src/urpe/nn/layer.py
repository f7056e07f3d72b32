"""One Transformer block: a token mixer (attention or a Yun et al. mixer) and a feed-forward net."""

from __future__ import annotations

from torch import Tensor, nn

ACTIVATIONS = {"gelu": nn.GELU, "relu": nn.ReLU}


class FeedForward(nn.Sequential):
    def __init__(self, dim: int, hidden: int, activation: str = "gelu", dropout: float = 0.0):
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
        super().__init__(
            nn.Linear(dim, hidden), ACTIVATIONS[activation](), nn.Dropout(dropout),
            nn.Linear(hidden, dim),
        )  # fmt: skip


class TransformerLayer(nn.Module):
    """Residual mixer + feed-forward, with LayerNorm after (post-LN, the paper's RoBERTa host)
    or before (pre-LN) each residual branch."""

    def __init__(
        self,
        mixer: nn.Module,
        dim: int,
        ffn_dim: int,
        *,
        dropout: float = 0.0,
        norm_first: bool = False,
        activation: str = "gelu",
    ):
        super().__init__()
        self.mixer = mixer
        self.ffn = FeedForward(dim, ffn_dim, activation, dropout)
        self.norm_mixer, self.norm_ffn = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.dropout = nn.Dropout(dropout)
        self.norm_first = norm_first

    def forward(self, x: Tensor, *, memory: Tensor | None = None, **mixer_kwargs) -> Tensor:
        """x (B, L, E) -> (B, L, E).

        memory: (B, M, E) hidden states of earlier positions at this layer's input (what this
            layer saw as x for them); they join the keys and values (pre-LN: normalised like x).
        mixer_kwargs: key_padding_mask, attn_mask, is_causal, cache, positions, bias, gate.
        """
        if memory is not None:
            mixer_kwargs["memory"] = self.norm_mixer(memory) if self.norm_first else memory
        if self.norm_first:
            x = x + self.dropout(self.mixer(self.norm_mixer(x), **mixer_kwargs))
            return x + self.dropout(self.ffn(self.norm_ffn(x)))
        x = self.norm_mixer(x + self.dropout(self.mixer(x, **mixer_kwargs)))
        return self.norm_ffn(x + self.dropout(self.ffn(x)))
