"""The C++ kernel's fast forward paths against the reference in float64, with the default tiles.

On a CPU with AMX (and a torch build whose cpublas has the bf16 brgemm), bfloat16 keys and
values are packed once per call in blocks of 64 keys and multiplied by oneDNN's tile kernel;
on AVX-512 the float32 and bfloat16 row loops (logits, exp, gate, the weights rounded to
bfloat16) run in 512-bit registers. These cases sit on the edges of those paths: key counts
around the 64-key blocks (a partial last block, an odd count, fewer keys than one block),
head widths the packing takes or leaves to BLAS (odd D, Dv not a multiple of 16, Dv over one
64-column block), grouped queries, and every mask. Elsewhere (and below 256 query rows per kv
head, where packing does not pay) the same cases run the portable loops and BLAS, which must
agree just as well.
"""

from __future__ import annotations

import pytest
import torch

from urpe.kernels import Toeplitz, reference_attention
from urpe.kernels.cpp import cpp_attention, unavailable

from .kernel_cases import outputs_and_grads

pytestmark = pytest.mark.skipif(
    unavailable() is not None, reason=f"the C++ kernel is unavailable: {unavailable()}"
)
TOLERANCE = {torch.bfloat16: 2e-2, torch.float32: 1e-5}

# (B, H, Hkv, Lq, Lk, D, Dv); packing needs 256 query rows per kv head (Lq * H / Hkv)
SHAPES = (
    (1, 4, 1, 64, 130, 64, 64),  # a partial last key block
    (2, 4, 2, 129, 65, 32, 80),  # grouped queries; Dv in two column blocks (64 + 16)
    (1, 4, 1, 64, 63, 16, 16),  # fewer keys than one block, odd
    (1, 2, 2, 256, 1, 64, 48),  # one key
    (1, 2, 2, 40, 90, 33, 24),  # odd D, Dv off the 16 grid, few queries: BLAS products
)


def _case(shape, mask: str, dtype: torch.dtype, seed: int = 0, views: bool = False):
    """views: q, k, v as views of (B, L, H, D) projections (read in place, rows H * D apart)."""
    b, h, hkv, lq, lk, d, dv = shape
    gen = torch.Generator().manual_seed(seed)

    def operand(heads: int, length: int, width: int) -> torch.Tensor:
        if views:
            return torch.randn(b, length, heads, width, generator=gen).transpose(1, 2)
        return torch.randn(b, heads, length, width, generator=gen)

    q, k, v = operand(h, lq, d), operand(hkv, lk, d), operand(hkv, lk, dv)
    table_b = torch.randn(h, 2 * max(lq, lk) + 1, generator=gen).mul(0.5)
    table_c = torch.randn(h, 2 * max(lq, lk) + 1, generator=gen).mul(0.2).add(1)
    tensors = [t.to(dtype).requires_grad_() for t in (q, k, v, table_b, table_c)]
    call = dict(is_causal="causal" in mask, enable_gqa=hkv != h)
    if "padding" in mask:
        padding = torch.rand(b, lk, generator=gen) < 0.3
        padding[0, -1] = True
        call["key_padding_mask"] = padding
    if "bool" in mask:
        call["attn_mask"] = torch.rand(b, 1, lq, lk, generator=gen) > 0.2
    if "float" in mask:
        call["attn_mask"] = torch.randn(1, h, lq, lk, generator=gen).to(dtype)
    return tensors, call


def _check(shape, mask: str, dtype: torch.dtype, views: bool = False, **extra) -> None:
    tensors, call = _case(shape, mask, dtype, views=views)
    terms = dict(bias=Toeplitz(tensors[3]), gate=Toeplitz(tensors[4]))
    got = outputs_and_grads(cpp_attention, tensors[:3], tensors, call | terms | extra)
    exact = [t.detach().double().requires_grad_() for t in tensors]
    exact_call = call | dict(bias=Toeplitz(exact[3]), gate=Toeplitz(exact[4])) | extra
    if "attn_mask" in call and call["attn_mask"].is_floating_point():
        exact_call["attn_mask"] = call["attn_mask"].double()
    want = outputs_and_grads(reference_attention, exact[:3], exact, exact_call)
    assert got[0].dtype == dtype
    _assert_close(got, want, TOLERANCE[dtype])


def _assert_close(got, want, tol: float) -> None:
    """Relative to each tensor's largest entry: exp's unnormalised outputs and the table
    gradients (sums of many terms) grow past 1, and bfloat16 weights carry 2^-9 of it."""
    for g, r in zip((got[0], *got[1]), (want[0], *want[1]), strict=True):
        scale = r.abs().max().clamp_min(1)
        torch.testing.assert_close(g.double() / scale, r / scale, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("mask", ["none", "causal+padding"])
def test_edges_of_the_packed_blocks_match_reference(shape, mask, dtype):
    _check(shape, mask, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", SHAPES[:2], ids=lambda s: "x".join(map(str, s)))
def test_views_of_projections_on_the_fast_paths_match_reference(shape, dtype):
    """q, k, v read where they lie (views of (B, L, H, D)): the packed keys and values are
    gathered from rows a stride apart, and the gradients written in that layout."""
    _check(shape, "causal+padding", dtype, views=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("mask", ["bool", "float", "causal+bool+padding"])
def test_masks_in_the_vector_logits_loop_match_reference(mask, dtype):
    _check(SHAPES[1], mask, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("normalization", ["l2", "exp", "relu2"])
def test_other_normalisations_on_the_fast_paths_match_reference(normalization, dtype):
    extra = dict(normalization=normalization)
    if normalization == "exp":
        extra["scale"] = 0.05  # exp has no denominator: keep the logits small
    _check(SHAPES[0], "causal+padding", dtype, **extra)


def test_logits_far_apart_and_hidden_rows_match_reference():
    """Logits hundreds apart (most weights underflow to exactly 0 in the vector exp, as in
    exp_value), and rows whose keys are all hidden (all-zero output)."""
    tensors, call = _case(SHAPES[0], "none", torch.float32)
    with torch.no_grad():
        tensors[0].mul_(30)  # |q . k| / sqrt(D) up to a few hundred
    padding = torch.zeros(1, SHAPES[0][4], dtype=torch.bool)
    padding[0, 1::2] = True
    mask = torch.ones(1, 1, SHAPES[0][3], SHAPES[0][4], dtype=torch.bool)
    mask[..., :5, :] = False  # the first five queries see nothing
    call |= dict(key_padding_mask=padding, attn_mask=mask)
    terms = dict(bias=Toeplitz(tensors[3]), gate=Toeplitz(tensors[4]))
    got = outputs_and_grads(cpp_attention, tensors[:3], tensors, call | terms)
    exact = [t.detach().double().requires_grad_() for t in tensors]
    exact_call = call | dict(bias=Toeplitz(exact[3]), gate=Toeplitz(exact[4]))
    want = outputs_and_grads(reference_attention, exact[:3], exact, exact_call)
    assert (got[0][..., :5, :] == 0).all()
    _assert_close(got, want, 1e-4)
