"""Every backend against the reference (the specification): one suite, the shared kernel cases.

Forward output and every gradient (q, k, v, the bias and gate tensors) in float64, over every
normalisation, mask (none, causal, key padding, both), bias/gate form (Toeplitz, Relation, dense,
broadcast, shared) and shape (odd lengths, Lq < Lk and Lq > Lk, grouped queries) that the
backend's capability table accepts: the table, not this file, says what a backend runs.

The tiled CPU kernels (blockwise, cpp) run the whole grid with tiles small enough that every
case spans several query and key blocks. The emulated GPU backends run a rotation of it (each
normalisation meets each mask; term kinds and shapes rotate): Triton under its CPU interpreter
(conftest sets TRITON_INTERPRET=1), FlexAttention eagerly with PyTorch's CPU-backward refusal
lifted (its own backward supplies the gradients, as on a GPU), and SDPA. With CUDA they run
natively. The reference itself is checked against an independent loop in test_reference.py.
What is particular to one backend stays in its own file (test_blockwise, test_cpp, test_triton,
test_flex).
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.attention.flex_attention as flex_module

from urpe.kernels import (
    BACKENDS,
    NORMALIZATIONS,
    Relation,
    Toeplitz,
    attention,
    reference_attention,
)
from urpe.kernels.blockwise import blockwise_attention
from urpe.kernels.cpp import cpp_attention, unavailable
from urpe.kernels.flex import flex_urpe_attention
from urpe.kernels.triton import triton_attention

from .kernel_cases import (
    MASKS,
    SHAPES,
    SMALL_TILES,
    TERMS,
    assert_close,
    case,
    outputs_and_grads,
)

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def _without_gqa(call: dict) -> dict:
    """Triton's and FlexAttention's own functions always allow grouped queries."""
    return {name: value for name, value in call.items() if name != "enable_gqa"}


def _lifted_flex(q, k, v, **call):
    check = flex_module._validate_device
    flex_module._validate_device = lambda *args: None  # a no-op on CUDA
    try:
        return flex_urpe_attention(q, k, v, **_without_gqa(call), flex=flex_module.flex_attention)
    finally:
        flex_module._validate_device = check


# backend -> its call on the shared cases
RUNNERS = {
    "blockwise": lambda *a, **c: blockwise_attention(*a, **c, **SMALL_TILES),
    "cpp": lambda *a, **c: cpp_attention(*a, **c, **SMALL_TILES),
    "triton": lambda *a, **c: triton_attention(*a, **_without_gqa(c)),
    "flex": _lifted_flex,
    "sdpa": lambda *a, **c: attention(*a, **c, backend="sdpa"),
}
FULL_GRID = ("blockwise", "cpp")  # cheap per case: every combination


def _kind(term: str | None) -> str | None:
    """The form a term of the shared cases takes, as the capability tables name it."""
    return None if term is None else term.split("_")[0]  # "toeplitz_shared" -> "toeplitz"


def _accepts(name: str, terms: tuple) -> bool:
    table = BACKENDS[name].capabilities
    return all(
        _kind(term) is None or table.takes(role, _kind(term))
        for term, role in zip(terms, ("bias", "gate"), strict=True)
    )


def _grid(name: str) -> list[tuple]:
    """(normalization, mask, terms, shape) for this backend, from its capability table."""
    table = BACKENDS[name].capabilities
    norms = [n for n in NORMALIZATIONS if table.implements(NORMALIZATIONS[n])]
    terms = [t for t in TERMS if _accepts(name, t)]
    if name in FULL_GRID:
        return list(itertools.product(norms, MASKS, terms, SHAPES))
    return [
        (norm, mask, terms[(i + j) % len(terms)], SHAPES[(i + 2 * j) % len(SHAPES)])
        for (i, norm), (j, mask) in itertools.product(enumerate(norms), enumerate(MASKS))
    ]


def _id(name: str, norm: str, mask: str, terms: tuple, shape: tuple) -> str:
    return f"{name}-{norm}-{mask}-{terms[0]}-{terms[1]}-" + "x".join(map(str, shape))


CASES = [
    pytest.param(
        name,
        *params,
        id=_id(name, *params),
        marks=pytest.mark.skipif(
            name == "cpp" and unavailable() is not None,
            reason=f"the C++ kernel is unavailable: {unavailable()}",
        ),
    )
    for name in RUNNERS
    for params in _grid(name)
]


@pytest.mark.parametrize(("backend", "normalization", "mask", "terms", "shape"), CASES)
def test_forward_and_every_gradient_match_the_reference(backend, normalization, mask, terms, shape):
    qkv, params, call = case(shape, mask, *terms)
    call["normalization"] = normalization
    if normalization == "exp":
        call["scale"] = 0.05  # exp has no denominator: keep the logits small
    want = outputs_and_grads(reference_attention, qkv, params, call)
    assert_close(outputs_and_grads(RUNNERS[backend], qkv, params, call), want)


def test_every_backend_built_for_a_device_is_in_the_suite():
    """A backend registered later fails here until it has a runner (and so its grid)."""
    built = {name for name in BACKENDS if name != "reference"}
    assert built <= set(RUNNERS), built - set(RUNNERS)
    assert all(_grid(name) for name in RUNNERS)  # every table accepts some shared case


TILED = {"blockwise": blockwise_attention, "cpp": cpp_attention}


def _tiled(backend: str):
    if backend == "cpp" and unavailable() is not None:
        pytest.skip(f"the C++ kernel is unavailable: {unavailable()}")
    return TILED[backend]


@pytest.mark.parametrize("tiles", [(1, 1), (4, 64), (64, 5), (7, 3), (3, 1000)])
@pytest.mark.parametrize("backend", list(TILED))
def test_tile_sizes_do_not_matter(backend, tiles):
    kernel = _tiled(backend)
    qkv, params, call = case((2, 2, 11, 19, 16), "causal+padding", "toeplitz", "toeplitz")
    want = outputs_and_grads(reference_attention, qkv, params, call)
    got = outputs_and_grads(
        lambda *a, **c: kernel(*a, **c, block_q=tiles[0], block_k=tiles[1]), qkv, params, call
    )
    assert_close(got, want)


@pytest.mark.parametrize("backend", list(TILED))
def test_gradcheck_tiny(backend):
    """Finite differences on a tiny call with dropout, key padding, causal masking and both
    table forms, tiles of 2 x 3."""
    kernel = _tiled(backend)
    qkv, params, call = case((1, 2, 5, 7, 4), "causal+padding", "toeplitz", "relation")
    call["key_padding_mask"][0] = torch.tensor([0, 0, 1, 0, 0, 1, 0], dtype=torch.bool)
    index = call["gate"].index

    def fn(q, k, v, tb, tc):
        rest = {key: value for key, value in call.items() if key not in ("bias", "gate")}
        return kernel(
            q,
            k,
            v,
            bias=Toeplitz(tb),
            gate=Relation(tc, index),
            **rest,
            block_q=2,
            block_k=3,
            dropout_p=0.3,
            dropout_seed=7,
        )

    assert torch.autograd.gradcheck(fn, (*qkv, params[3], params[4]))


@pytest.mark.parametrize("normalization", list(NORMALIZATIONS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("backend", list(TILED))
def test_lower_precision_close_to_reference(backend, dtype, normalization):
    """Against the float64 reference on the same (rounded) inputs: the reference run in half
    precision would sum the table gradients in half precision itself, the kernels in float32."""
    kernel = _tiled(backend)
    gen = torch.Generator().manual_seed(1)
    b, h, lq, lk, d = 2, 4, 33, 47, 32
    q, k, v = (torch.randn(b, h, n, d, generator=gen).to(dtype) for n in (lq, lk, lk))
    table_b = torch.randn(h, 21, generator=gen).mul(0.3).to(dtype)
    table_c = torch.randn(h, 21, generator=gen).mul(0.2).add(1).to(dtype)
    tensors = [t.requires_grad_() for t in (q, k, v, table_b, table_c)]
    padding = torch.rand(b, lk, generator=gen) < 0.2
    call = dict(
        bias=Toeplitz(table_b),
        gate=Toeplitz(table_c),
        is_causal=True,
        key_padding_mask=padding,
        normalization=normalization,
        scale=0.05 if normalization == "exp" else None,
    )
    tiled = lambda *a, **c: kernel(*a, **c, **SMALL_TILES)  # noqa: E731
    got = outputs_and_grads(tiled, (q, k, v), tensors, call)
    assert got[0].dtype == dtype and all(g.dtype == dtype for g in got[1])
    exact = [t.detach().double().requires_grad_() for t in tensors]
    exact_call = call | dict(bias=Toeplitz(exact[3]), gate=Toeplitz(exact[4]))
    want = outputs_and_grads(reference_attention, exact[:3], exact, exact_call)
    tol = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 1e-5}[dtype]
    # relative to the largest entry: exp's outputs and the table gradients sum many terms
    for g, r in zip((got[0], *got[1]), (want[0], *want[1]), strict=True):
        scale = r.abs().max().clamp_min(1)
        torch.testing.assert_close(g.double() / scale, r / scale, atol=tol, rtol=tol)
