"""Every tensor input at any layout, on every backend, against the reference.

A kernel may not assume that what it is given is contiguous: q, k, v, a dense bias or gate,
both masks and a relation index arrive here transposed in memory, sliced with a step, or
expanded (stride 0), at the edges Lq = 1, Lk = 1 and D = 1. A key padding mask with Lk = 1 whose
last stride is not 1 (`pad.t()` of a (1, B) tensor) once made the C++ kernel raise, and "auto"
did not fall back.
"""

from __future__ import annotations

import pytest
import torch

from urpe.kernels import Relation, attention, reference_attention
from urpe.kernels.cpp import unavailable as cpp_unavailable

from .test_broadcast_masks import check_case

F64 = dict(dtype=torch.float64)
BACKENDS = ("blockwise", "cpp", "auto", "sdpa", "triton")


def test_a_key_padding_mask_of_one_key_with_any_strides():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3, 2, 4, 8, generator=gen, **F64)
    k = torch.randn(3, 2, 1, 8, generator=gen, **F64)
    v = torch.randn(3, 2, 1, 5, generator=gen, **F64)
    pad = torch.tensor([[False, True, False]]).t()  # (3, 1), strides (1, 3)
    assert pad.stride() == (1, 3)
    want = reference_attention(q, k, v, key_padding_mask=pad)
    assert want[1].abs().sum() == 0 and want[0].abs().sum() > 0
    for backend in ("auto", "blockwise", "cpp"):
        if backend == "cpp" and cpp_unavailable() is not None:
            continue
        got = attention(q, k, v, key_padding_mask=pad, backend=backend)
        torch.testing.assert_close(got, want, msg=backend)
        got = attention(q, k, v, key_padding_mask=pad, normalization="relu2", backend=backend)
        torch.testing.assert_close(
            got, reference_attention(q, k, v, key_padding_mask=pad, normalization="relu2")
        )


def _strided(t: torch.Tensor, step: int = 2) -> torch.Tensor:
    """The same values, laid out with the last two dims swapped in memory and every other
    entry of the last dim skipped: no stride of 1 anywhere."""
    wide = t.new_zeros(*t.shape[:-1], t.shape[-1] * step)
    wide[..., ::step] = t
    return wide.transpose(-1, -2).contiguous().transpose(-1, -2)[..., ::step]


def _expanded(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """t's first entry along `dim` repeated `size` times, as a stride-0 view."""
    return t.narrow(dim, 0, 1).expand(*t.shape[:dim], size, *t.shape[dim + 1 :])


def _layout_case(layout: str, lq: int, lk: int, d: int, normalization: str) -> dict:
    """A call with every input at `layout`: GQA, dense bias, relation gate, both masks."""
    b, h, hkv, dv = 2, 2, 1, 3
    gen = torch.Generator().manual_seed(lq * 100 + lk * 10 + d)
    q = torch.randn(b, h, lq, d, generator=gen, **F64).requires_grad_()
    k = torch.randn(b, hkv, lk, d, generator=gen, **F64).requires_grad_()
    v = torch.randn(b, hkv, lk, dv, generator=gen, **F64).requires_grad_()
    bias = torch.randn(b, h, lq, lk, generator=gen, **F64).requires_grad_()
    float_mask = torch.randn(1, h, lq, lk, generator=gen, **F64).requires_grad_()
    keep = torch.rand(b, 1, lq, lk, generator=gen) < 0.8
    pad = torch.rand(b, lk, generator=gen) < 0.3
    table = (1 + 0.3 * torch.randn(h, 5, generator=gen, **F64)).requires_grad_()
    index = torch.randint(0, 5, (b, lq, lk), generator=gen)
    if layout == "strided":
        q, k, v, bias, float_mask = (_strided(t) for t in (q, k, v, bias, float_mask))
        keep, pad, index = _strided(keep), _strided(pad), _strided(index)
    elif layout == "expanded":  # stride 0 along batch, heads, queries or keys
        q, k, v = _expanded(q, 0, b), _expanded(k, 1, hkv), _expanded(v, 2, lk)
        bias, float_mask = _expanded(bias, 3, lk), _expanded(float_mask, 2, lq)
        keep, pad, index = _expanded(keep, 0, b), _expanded(pad, 1, lk), _expanded(index, 1, lq)
    mask = keep if normalization in ("softmax", "relu2") else float_mask
    call = dict(
        enable_gqa=True,
        normalization=normalization,
        key_padding_mask=pad,
        bias=bias,
        gate=Relation(table, index),
        attn_mask=mask,
    )
    params = [q, k, v, bias, table] + ([float_mask] if mask is float_mask else [])
    return dict(qkv=(q, k, v), params=params, call=call, seed=None)


@pytest.mark.parametrize("layout", ["contiguous", "strided", "expanded"])
@pytest.mark.parametrize(
    ("lq", "lk", "d", "normalization"),
    [(1, 7, 4, "softmax"), (6, 1, 4, "relu2"), (5, 7, 1, "l2"), (1, 1, 1, "exp")],
)
def test_inputs_at_any_layout_match_the_reference(layout, lq, lk, d, normalization):
    case = _layout_case(layout, lq, lk, d, normalization)
    if layout != "contiguous":
        assert not all(t.is_contiguous() for t in case["params"][:4])
    backends = [n for n in BACKENDS if n != "cpp" or cpp_unavailable() is None]
    ran = check_case(case, backends)
    assert {"blockwise", "auto", "triton"} <= set(ran), ran
