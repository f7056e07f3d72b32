"""Packed rows with a padded tail on the Triton kernel, against the reference in float64: outputs
and the gradients of q, k, v and of the terms. Key padding narrows the keys a block walks to
those between its first and last unpadded key, and a dK/dV block of padded keys walks no query;
tiles of 16 x 16 (the interpreter's, and the raw op's here) make every kind of tile occur (all
padded, partly padded, whole).

Under Triton's interpreter without a GPU (conftest sets TRITON_INTERPRET=1), natively with one.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from urpe.kernels import Toeplitz, attention
from urpe.kernels.layout import ForwardArgs
from urpe.kernels.spec import resolve
from urpe.kernels.triton.ops import TRITON

from .test_triton import DEVICE, _outputs_and_grads

F64 = dict(dtype=torch.float64, device=DEVICE)
TILE = 16
# (B, H, Hkv, Lq, Lk, real tokens per row): the last key of every row is in a tile of padding
# only (real lengths up to 40 of 70: keys 48-69 are padded in each row)
SHAPES = ((2, 2, 1, 70, 70, (20, 40)), (1, 2, 2, 40, 70, (33,)))
# how the tail is hidden: key padding alone (padded queries still see the real keys); key
# padding and a document of its own; one document per padded token; both; padding in front
TAILS = ("padding", "padding_document", "distinct_ids", "distinct_ids+padding", "left_padding")


def tail_case(shape, tail, causal, seed=0):
    b, h, hkv, lq, lk, real = shape
    gen = torch.Generator().manual_seed(seed)

    def randn(*size):
        return torch.randn(*size, generator=gen, dtype=torch.float64).to(DEVICE)

    q, k, v = randn(b, h, lq, 8), randn(b, hkv, lk, 8), randn(b, hkv, lk, 8)
    lengths = torch.tensor(real if len(real) == b else real * b, device=DEVICE)[:, None]
    positions = torch.arange(lk, device=DEVICE)
    padded = positions >= lengths  # (B, Lk)
    if tail == "left_padding":
        padded = positions < lk - lengths
    call = dict(is_causal=causal, enable_gqa=True)
    if "padding" in tail:
        call["key_padding_mask"] = padded
    documents = positions // 9
    if tail == "padding_document":
        call["document_ids"] = torch.where(padded, 1000, documents)
    if tail.startswith("distinct_ids"):
        call["document_ids"] = torch.where(padded, 1000 + positions, documents)
    bias = (0.3 * randn(h, 2 * lk - 1)).requires_grad_()
    gate = (torch.rand(h, 2 * lk - 1, generator=gen, dtype=torch.float64) + 0.5).to(DEVICE)
    gate.requires_grad_()
    call.update(bias=Toeplitz(bias), gate=Toeplitz(gate))
    qkv = tuple(t.requires_grad_() for t in (q, k, v))
    return qkv, [*qkv, bias, gate], call


def reference(*qkv, **call):
    return attention(*qkv, **call, backend="reference")


def assert_same(got, want):
    torch.testing.assert_close(got[0], want[0], atol=1e-9, rtol=1e-9)
    for n, (g, w) in enumerate(zip(got[1], want[1], strict=True)):
        torch.testing.assert_close(g, w, atol=1e-9, rtol=1e-9, msg=lambda m, n=n: f"grad {n}: {m}")


NORMS = ("softmax", "exp", "l2", "relu2")
# every normalisation x tail; two in the default run (the interpreter takes ~3 s a case and the
# default run must stay under 10 minutes), the rest with make test-slow
CASES = [
    pytest.param(
        norm,
        tail,
        SHAPES[n % 2],
        n % 3 != 0,
        marks=() if NORMS.index(norm) == TAILS.index(tail) < 2 else pytest.mark.slow,
    )
    for n, (norm, tail) in enumerate(itertools.product(NORMS, TAILS))
]


@pytest.mark.parametrize(("norm", "tail", "shape", "causal"), CASES)
def test_padded_tails_match_the_reference(norm, tail, shape, causal):
    qkv, params, call = tail_case(shape, tail, causal)
    call.update(normalization=norm, scale=0.1 if norm == "exp" else None)
    want = _outputs_and_grads(reference, qkv, params, call)
    got = _outputs_and_grads(
        lambda *a, **c: attention(*a, **c, backend="triton"), qkv, params, call
    )
    assert_same(got, want)


@pytest.mark.parametrize(
    "tail",
    [
        pytest.param("padding", marks=pytest.mark.slow),
        "padding_document",
        pytest.param("left_padding", marks=pytest.mark.slow),
    ],
)
def test_tiles_of_padded_keys_are_never_read(tail):
    """NaN in every padded key and value of the tiles that hold padding only, given to the
    kernel's op directly (urpe.attention would have zeroed them first): a tile that was read
    would bring 0 * NaN into the output and dQ; skipped, the result is the reference's."""
    qkv, params, call = tail_case(SHAPES[0], tail, causal=tail == "left_padding")
    padded = call["key_padding_mask"]  # (B, Lk)
    unread = torch.zeros_like(padded)
    for j0 in range(0, padded.shape[1], TILE):  # key tiles of padding only
        unread[:, j0 : j0 + TILE] = padded[:, j0 : j0 + TILE].all(-1, keepdim=True)
    assert unread.any()
    unread = unread[:, None, :, None]  # (B, 1, Lk, 1)
    q, k, v = (t.detach() for t in qkv)
    poisoned = (q, k.masked_fill(unread, float("nan")), v.masked_fill(unread, float("nan")))
    poisoned = tuple(t.requires_grad_() for t in poisoned)

    def raw(q, k, v, **c):
        return TRITON(ForwardArgs.from_spec(resolve(q, k, v, **c), TILE, TILE))

    want = _outputs_and_grads(reference, qkv, params, call)
    got = _outputs_and_grads(raw, poisoned, [*poisoned, *params[3:]], call)
    assert_same(got, want)
