"""Forgetting attention (FoX: Lin, Nikishin, He and Courville, "Forgetting Transformer: Softmax
Attention with a Forget Gate", ICLR 2025, Eq. 4-6): a data-dependent decay bias.

Every token t carries a forget gate per head, computed from the layer's input x_t,

    f_t = sigmoid(w_h . x_t + b_h),        b_ij = sum_{t = j+1 .. i} log f_t     (j <= i)

so a query discounts a key by how much was forgotten between them. The bias needs only the
per-token log f_t: it goes to `urpe.attention` as `urpe.Decay(log_forget)`, b_ij = -|c_i' - c_j|
with c = cumsum(log f) along the keys, never as a dense (L, L) tensor. With packed documents the
sum runs inside a document only (pairs across documents are masked), and with a KV cache the
log f of earlier keys travel in the cache (`key_state`). It combines with any gate C (URPE).
"""

from __future__ import annotations

from collections.abc import Callable

import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules import module as module_calls

from ..kernels import Decay, attention
from .base import RelativeEncoding, refuse_precomputed_bias
from .positions import Positions
from .registry import register_position

# f_0 = sigmoid(5) = 0.9933 per token: close to 1 (a query starts out seeing keys hundreds of
# tokens back), yet far enough from saturation for the gate's gradient (1 - f) to move it.
FORGET_OPTIONS = {"init_bias": 5.0}


def log_sigmoid(x: Tensor) -> Tensor:
    """log(sigmoid(x)) = -softplus(-x), computed as softplus(x, beta=-1): the same values and
    gradient, bit for bit, in one op instead of three (a decoding step runs it per layer).
    Not F.logsigmoid: its CPU kernel opens a parallel region even for a few entries, which then
    waits for a busy core's time slice (for the (1, 1, H) gates of a decoding step 2.3 us on one
    thread but 8-16 ms with the other core busy; issue 42; softplus: 5 us). The same values as
    it, but where x < -20 (softplus's linear branch, off by e^x < 2e-9), and the same gradient,
    sigmoid(-x)."""
    return F.softplus(x, beta=-1.0)


def linear(proj: nn.Module, x: Tensor) -> Tensor:
    """proj(x), computed as F.linear where proj is a plain nn.Linear (`plain_parameters`).
    Calling the module costs about as much as the product of a decoding step's one row (~23k of
    ~50k instructions, issue 42), and a step runs it per layer."""
    parameters = plain_parameters(proj)
    if parameters is None:
        return proj(x)
    return F.linear(x, *parameters)


def plain_parameters(proj: nn.Module) -> tuple[Tensor, Tensor | None] | None:
    """(weight, bias) of a plain nn.Linear that no hook watches and nothing replaced, whose
    call is exactly F.linear(x, weight, bias); None for anything else (PEFT, quantisation,
    accelerate's hooks: the module must be called). Parameters read from the module's dict: an
    attribute that nn.Module resolves in its __getattr__ costs ~5k instructions."""
    if (
        type(proj) is not nn.Linear
        or proj._forward_pre_hooks
        or proj._forward_hooks
        or proj._backward_pre_hooks
        or proj._backward_hooks
        or "forward" in proj.__dict__
        or module_calls._global_forward_pre_hooks
        or module_calls._global_forward_hooks
        or module_calls._global_backward_pre_hooks
        or module_calls._global_backward_hooks
    ):
        return None
    parameters = proj._parameters
    return parameters["weight"], parameters["bias"]


@register_position(
    "fox",
    lambda s: ForgetGate(s.dim, s.num_heads, init_bias=s.init_bias),
    uses_order=True,
    options=FORGET_OPTIONS,
)
class ForgetGate(RelativeEncoding):
    """FoX's forget gates: log f = logsigmoid(x W^T + b), one per token per head.

    Args:
        dim: width of the layer's key input x. num_heads: H.
        init_bias: b at initialisation, the same for every head (default 5: f ~ 0.993, near 1,
            so the model starts close to one without decay; the FoX code's default is 0,
            f = 0.5). init_std: W ~ N(0, init_std) (FoX's 0.02).
    """

    def __init__(self, dim: int, num_heads: int, init_bias: float = 5.0, init_std: float = 0.02):
        super().__init__()
        self.proj = nn.Linear(dim, num_heads)
        nn.init.normal_(self.proj.weight, std=init_std)
        nn.init.constant_(self.proj.bias, float(init_bias))

    def key_state(self, x: Tensor) -> Tensor:
        """x (B, L, dim) -> log f (B, H, L), every value <= 0."""
        return self.log_forget_rows(x).mT

    def log_forget_rows(self, x: Tensor) -> Tensor:
        """x (B, L, dim) -> log f (B, L, H), as the projection gives them (a transformers
        model's decoding step sums them into its cache's history without a transposed view)."""
        return log_sigmoid(linear(self._modules["proj"], x))

    def plain_projection(self) -> tuple[Tensor, Tensor | None] | None:
        """(W, b) where log f is exactly log_sigmoid(F.linear(x, W, b)): this class's own gates
        through a plain nn.Linear (`plain_parameters`); None for a subclass's own gates or a
        wrapped projection. A caller may then compute log f its own way (urpe.hf's decoding
        step fuses it with its sums: `forget_history.Cumulative.fused_step`)."""
        cls = type(self)
        if cls.key_state is not ForgetGate.key_state:
            return None
        if cls.log_forget_rows is not ForgetGate.log_forget_rows:
            return None
        return plain_parameters(self._modules["proj"])

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        positions: Positions,
        scale: float,
        bias=None,
        key_state: Tensor | None = None,
        calls: Callable[..., Tensor] = attention,
        **kwargs,
    ) -> Tensor:
        refuse_precomputed_bias(self, bias)
        if key_state is None:
            raise ValueError(
                "ForgetGate computes its decay from the layer's input: run it inside "
                "urpe.MultiheadAttention, which passes key_state=log f of every key"
            )
        return calls(q, k, v, bias=Decay(key_state.to(q.dtype)), scale=scale, **kwargs)
