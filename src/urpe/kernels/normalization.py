"""Row normalisations that turn logits s_ij into attention weights a_ij: one registry entry each.

Only softmax makes rows sum to 1; the other three are the row-sum-breaking variants Su (2022)
lists beside URPE. An entry states everything every kernel needs, so a new normalisation is added
here once and the reference, the blockwise kernel, dispatch and the tests pick it up:

- `weights(scores, keep)`: the reference formula on a whole (..., Lq, Lk) logit matrix. Hidden
  pairs (keep False) get exactly 0, and a row with no visible key is all 0, never NaN.
- For the blockwise kernel, which sees one tile of keys at a time, weights are written as
  a_ij = f(s_ij, r_i) for a per-row statistic r_i:
  - `running_power`: softmax (1) and l2 (2) need r_i from the whole row. The kernel keeps the
    online pair m_i = max_j s_ij, l_i = sum_j exp(s_ij - m_i)^power, rescaling as key tiles
    arrive, divides the output by l_i^(1/power) and saves r_i = m_i + log(l_i) / power, so that
    a_ij = exp(s_ij - r_i). None: r_i is known before the first tile (`fixed_statistic`).
  - `tile_weights(s, r)`: a_ij from a logit tile and r (in place on s); returns (a, aux), aux
    being whatever `grad_logits` needs besides a.
  - `grad_logits(dp, a, aux, delta, r)`: dS_ij = dL/ds_ij from dP_ij = dL/da_ij (in place on dp),
    delta_i = sum_j a_ij dP_ij when `needs_delta`.
  - `hidden_logit`: the value hidden logits take before `tile_weights` (gives a = 0).
  - `one_shot`: a fused whole-row implementation the kernel may use when one tile holds the
    whole row (softmax: `torch.softmax`); None if there is none.
- `overflows`: the weights have no upper bound (exp), so the result is checked for overflow.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .watched import WatchedDict


@dataclass(frozen=True)
class Normalization:
    """One row normalisation, with what every kernel needs of it (module docstring).

    Attributes:
        name: the name `urpe.attention(normalization=...)` takes.
        formula: the weights in words, for documentation and error messages.
        weights: (scores (..., Lq, Lk), keep bool or None) -> weights: the reference formula.
        tile_weights: (logit tile, row statistic r) -> (weights, aux), in place on the tile.
        grad_logits: (dP, weights, aux, delta, r) -> dS, in place on dP.
        running_power: 1 (softmax) or 2 (l2): r_i kept online as m_i + log(l_i) / power;
            None where r_i is known up front (`fixed_statistic`).
        fixed_statistic: visible-key counts (B, H, Lq, 1) -> r_i, or None.
        needs_delta: the backward needs delta_i = sum_j a_ij dP_ij (= rowsum(dO * O)).
        hidden_logit: the value a hidden logit takes before `tile_weights` (its weight is 0).
        one_shot: a fused whole-row form for a tile that holds the whole row, or None.
        rows_sum_to_one: every row of weights sums to 1 (softmax only).
        overflows: the weights have no upper bound (exp): results are checked for overflow.
    """

    name: str
    formula: str
    weights: Callable[[Tensor, Tensor | None], Tensor]
    tile_weights: Callable[[Tensor, Tensor], tuple[Tensor, Tensor | None]]
    grad_logits: Callable[[Tensor, Tensor, Tensor | None, Tensor | None, Tensor], Tensor]
    running_power: int | None = None
    fixed_statistic: Callable[[Tensor], Tensor] | None = None
    needs_delta: bool = False
    hidden_logit: float = float("-inf")
    one_shot: Callable[[Tensor], Tensor] | None = None
    rows_sum_to_one: bool = False
    overflows: bool = False


NORMALIZATIONS: dict[str, Normalization] = WatchedDict()  # prepared calls watch it


def register_normalization(norm: Normalization) -> Normalization:
    """Add (or replace) a normalisation; `urpe.attention(normalization=name)` then accepts it."""
    NORMALIZATIONS[norm.name] = norm
    return norm


register_normalization.registries = (NORMALIZATIONS,)  # for `registered`


# ---------------------------------------------------------------------------------------------
# Reference formulas on whole rows


def _masked(scores: Tensor, keep: Tensor | None, fill: float) -> Tensor:
    return scores if keep is None else scores.masked_fill(~keep, fill)


def _row_max(scores: Tensor) -> Tensor:
    # The shift cancels in softmax and l2, so it carries no gradient; rows that are all -inf
    # (nothing visible) shift by 0 instead of -inf to keep exp() finite.
    m = scores.detach().amax(dim=-1, keepdim=True)
    return torch.where(torch.isfinite(m), m, torch.zeros_like(m))


def _softmax_weights(scores: Tensor, keep: Tensor | None) -> Tensor:
    s = _masked(scores, keep, float("-inf"))
    e = torch.exp(s - _row_max(s))
    denom = e.sum(dim=-1, keepdim=True)
    return e / torch.where(denom > 0, denom, torch.ones_like(denom))


def _exp_weights(scores: Tensor, keep: Tensor | None) -> Tensor:
    return torch.exp(_masked(scores, keep, float("-inf")))


def _l2_weights(scores: Tensor, keep: Tensor | None) -> Tensor:
    s = _masked(scores, keep, float("-inf"))
    e = torch.exp(s - _row_max(s))
    sq = e.square().sum(dim=-1, keepdim=True)
    # an empty row has sq = 0, where sqrt's derivative is infinite: take the root of 1 there
    return e / torch.where(sq > 0, sq, torch.ones_like(sq)).sqrt()


def _relu2_weights(scores: Tensor, keep: Tensor | None) -> Tensor:
    a = torch.relu(_masked(scores, keep, 0.0)).square()
    if keep is None:
        return a / scores.shape[-1]
    n = keep.expand_as(scores).sum(dim=-1, keepdim=True).to(scores.dtype)
    return a / n.clamp_min(1)


# ---------------------------------------------------------------------------------------------
# Blockwise pieces


def _exp_tile(s: Tensor, r: Tensor) -> tuple[Tensor, None]:
    return s.sub_(r).exp_(), None  # a = exp(s - r)


def _relu2_tile(s: Tensor, n: Tensor) -> tuple[Tensor, Tensor]:
    relu = s.relu_()
    return relu.square().div_(n), relu  # a = relu(s)^2 / n; aux = relu(s)


def _softmax_grad(dp, a, aux, delta, r):
    return dp.sub_(delta).mul_(a)  # dS = a (dP - delta)


def _l2_grad(dp, a, aux, delta, r):
    return dp.addcmul_(a, delta, value=-1.0).mul_(a)  # dS = a (dP - a delta)


def _exp_grad(dp, a, aux, delta, r):
    return dp.mul_(a)  # dS = a dP


def _relu2_grad(dp, a, relu, delta, n):
    return dp.mul_(relu).mul_(2.0).div_(n)  # dS = dP 2 relu(s) / n


register_normalization(
    Normalization(
        name="softmax",
        formula="a_ij = exp(s_ij) / sum_j exp(s_ij)",
        weights=_softmax_weights,
        tile_weights=_exp_tile,
        grad_logits=_softmax_grad,
        running_power=1,
        needs_delta=True,
        one_shot=lambda s: torch.softmax(s, -1, out=s),
        rows_sum_to_one=True,
    )
)
register_normalization(
    Normalization(
        name="exp",
        formula="a_ij = exp(s_ij) (no denominator)",
        weights=_exp_weights,
        tile_weights=_exp_tile,
        grad_logits=_exp_grad,
        fixed_statistic=torch.zeros_like,
        overflows=True,
    )
)
register_normalization(
    Normalization(
        name="l2",
        formula="a_ij = exp(s_ij) / sqrt(sum_j exp(2 s_ij))",
        weights=_l2_weights,
        tile_weights=_exp_tile,
        grad_logits=_l2_grad,
        running_power=2,
        needs_delta=True,
    )
)
register_normalization(
    Normalization(
        name="relu2",
        formula="a_ij = relu(s_ij)^2 / n_i, n_i the number of keys query i sees",
        weights=_relu2_weights,
        tile_weights=_relu2_tile,
        grad_logits=_relu2_grad,
        fixed_statistic=lambda counts: counts.clamp_min(1),
        hidden_logit=0.0,
    )
)
