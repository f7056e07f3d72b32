"""Merging the rows that one query chunk gets from several key chunks into the whole row's.

A kernel run on one chunk of keys returns its output out_c and its row statistic r_c
(`urpe.kernels.layout`): the weights it applied are a_ij = f(s_ij, r_c) over that chunk's keys.
Per normalisation (`urpe.kernels.normalization`) the whole row follows from the chunks':

- running power p (softmax 1, l2 2): the chunk's weights are exp(s_ij - r_c), the row's
  exp(s_ij - r) with exp(p r) = sum_j exp(p s_ij) = sum_c exp(p r_c), so

      r = (1/p) logsumexp_c(p r_c),    out = sum_c exp(r_c - r) out_c.

  URPE's gate C and dropout multiply the weights after the normalisation, inside each out_c:
  they never enter r, so the merge is exact with them.
- exp: no denominator (r = 0): out = sum_c out_c.
- relu2: a_ij = relu(s_ij)^2 / n_i with n_i the keys query i sees in the whole row: the chunk
  divided by its own count (its statistic), so out = sum_c r_c out_c / n, n = sum_c n_c.

A chunk in which a row sees no key gives r_c = inf (no weight at all): it adds nothing. A row
that sees no key anywhere ends with out = 0 and r = inf, as a one-process kernel gives it. The
backward pass hands each chunk's kernel the merged (out, r): softmax's and l2's delta_i =
rowsum(dO * out) is then the whole row's.
"""

from __future__ import annotations

import torch
from torch import Tensor

MERGED = ("softmax", "l2", "exp", "relu2")  # the normalisations with a merge rule here
RUNNING_POWER = {"softmax": 1, "l2": 2}


class RowMerge:
    """Accumulates chunk results (out_c, r_c) into rows of a (B, H, L, Dv) output."""

    def __init__(self, normalization: str, shape: tuple[int, ...], dtype, device) -> None:
        b, h, length, _ = shape
        self.normalization = normalization
        self.power = RUNNING_POWER.get(normalization)
        self.out = torch.zeros(shape, dtype=dtype, device=device)
        if self.power is not None:  # r so far; -inf: no key yet
            self.stat = torch.full((b, h, length, 1), float("-inf"), dtype=dtype, device=device)
        elif normalization == "relu2":  # n so far
            self.stat = torch.zeros(b, h, length, 1, dtype=dtype, device=device)
        else:
            self.stat = torch.zeros(b, h, length, 1, dtype=dtype, device=device)

    def add(self, rows: slice, out: Tensor, stat: Tensor, counts: Tensor | None = None) -> None:
        """A chunk's (out (B, H, C, Dv), r (B, H, C, 1)) for rows `rows`; relu2 also takes the
        chunk's visible-key counts (B|1, H|1, C)."""
        acc, acc_stat = self.out[:, :, rows], self.stat[:, :, rows]
        out = out.to(acc.dtype)
        if self.power is not None:
            p = self.power
            chunk = torch.where(torch.isfinite(stat), stat.to(acc.dtype), float("-inf"))
            merged = torch.logaddexp(p * acc_stat, p * chunk) / p
            seen = torch.isfinite(merged)
            old = torch.where(seen, torch.exp(acc_stat - merged), 0.0)
            new = torch.where(seen, torch.exp(chunk - merged), 0.0)
            acc.mul_(old).add_(out * new)
            acc_stat.copy_(merged)
        elif self.normalization == "relu2":
            acc.add_(out * stat.to(acc.dtype))  # back to sum_j relu(s_ij)^2 c_ij v_j
            acc_stat.add_(counts.to(acc.dtype)[..., None])
        else:
            acc.add_(out)

    def result(self) -> tuple[Tensor, Tensor]:
        """(out (B, H, L, Dv), r (B, H, L, 1)): what a one-process kernel returns."""
        if self.power is not None:
            stat = torch.where(torch.isfinite(self.stat), self.stat, float("inf"))
            return self.out, stat
        if self.normalization == "relu2":
            n = self.stat.clamp_min(1)
            return self.out.div_(n), n
        return self.out, self.stat
