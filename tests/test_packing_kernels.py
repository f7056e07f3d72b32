"""`document_ids` and `Decay` on every CPU backend against the reference, in float64: outputs and
the gradients of q, k, v, log_forget and the gate's table. Small tiles make every case span
several query and key blocks, so document tiles are both compared and skipped."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from urpe.kernels import NORMALIZATIONS, Decay, Relation, Toeplitz, attention, select_backend
from urpe.kernels.blockwise import blockwise_attention
from urpe.kernels.blockwise.kernel import _plan, _tiles, blockwise_forward
from urpe.kernels.cpp import cpp_attention, unavailable
from urpe.kernels.layout import ForwardArgs
from urpe.kernels.reference import reference_run
from urpe.kernels.spec import resolve

F64 = dict(dtype=torch.float64)
TILES = dict(block_q=4, block_k=8)

# (B, H, Hkv, Lq, Lk): grouped queries, odd lengths, Lq < Lk (a cache)
SHAPES = ((2, 4, 2, 13, 13), (1, 2, 2, 5, 21), (2, 2, 1, 30, 30))
MASKS = ("none", "causal", "padding", "causal+padding+bool")
TERMS = ("decay", "decay+toeplitz_gate", "decay_shared+relation_gate", "toeplitz+dense_gate")
IDS = ("sorted", "unsorted", "length_one")


def document_ids(kind: str, b: int, lk: int, gen) -> torch.Tensor:
    if kind == "sorted":  # contiguous runs of 1 to 9 tokens
        lengths = torch.randint(1, 10, (b, lk), generator=gen)
        return (lengths.cumsum(-1)[:, :, None] <= torch.arange(lk)).sum(-2).clamp_max(lk)
    if kind == "unsorted":
        return torch.randint(0, 3, (b, lk), generator=gen)
    return torch.arange(lk).expand(b, lk) // torch.tensor([[1], [2]])[:b]  # length 1 (and 2)


def make_case(shape, mask, terms, ids, seed=0):
    b, h, hkv, lq, lk = shape
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, lq, 8, generator=gen, **F64).requires_grad_()
    k = torch.randn(b, hkv, lk, 8, generator=gen, **F64).requires_grad_()
    v = torch.randn(b, hkv, lk, 5, generator=gen, **F64).requires_grad_()
    params = [q, k, v]
    call = dict(
        document_ids=document_ids(ids, b, lk, gen), is_causal="causal" in mask, enable_gqa=True
    )
    if "padding" in mask:
        call["key_padding_mask"] = torch.rand(b, lk, generator=gen) < 0.2
    if "bool" in mask:
        call["attn_mask"] = torch.rand(lq, lk, generator=gen) < 0.8
    if terms.startswith("decay"):
        heads = 1 if "shared" in terms else h
        raw = torch.randn(b, heads, lk, generator=gen, **F64)
        log_forget = torch.nn.functional.logsigmoid(raw + 1).requires_grad_()
        call["bias"] = Decay(log_forget)
        params.append(log_forget)
    if terms.startswith("toeplitz"):
        table = torch.randn(h, 7, generator=gen, **F64).requires_grad_()
        call["bias"] = Toeplitz(table)
        params.append(table)
    if "toeplitz_gate" in terms:
        table = (torch.rand(h, 9, generator=gen, **F64) + 0.5).requires_grad_()
        call["gate"] = Toeplitz(table)
        params.append(table)
    if "relation_gate" in terms:
        table = (torch.rand(h, 4, generator=gen, **F64) + 0.5).requires_grad_()
        call["gate"] = Relation(table, torch.randint(0, 4, (b, lq, lk), generator=gen))
        params.append(table)
    if "dense_gate" in terms:
        gate = torch.rand(b, h, lq, lk, generator=gen, **F64).requires_grad_()
        call["gate"] = gate
        params.append(gate)
    return (q, k, v), params, call


def outputs_and_grads(fn, qkv, params, call):
    out = fn(*qkv, **call)
    weight = torch.linspace(-1, 1, out.numel(), **F64).view_as(out)
    return out, torch.autograd.grad((out * weight).sum(), params)


def assert_same(got, want):
    torch.testing.assert_close(got[0], want[0], atol=1e-10, rtol=1e-8)
    for n, (g, w) in enumerate(zip(got[1], want[1], strict=True)):
        torch.testing.assert_close(g, w, atol=1e-10, rtol=1e-8, msg=lambda m, n=n: f"grad {n}: {m}")


def reference(*qkv, **call):
    return attention(*qkv, **call, backend="reference")


KERNELS = {"blockwise": lambda *a, **c: blockwise_attention(*a, **c, **TILES)}
KERNELS["blockwise_default_tiles"] = blockwise_attention
if unavailable() is None:
    KERNELS["cpp"] = lambda *a, **c: cpp_attention(*a, **c, **TILES)
    KERNELS["cpp_default_tiles"] = cpp_attention

# every normalisation x term x mask once; shapes and id kinds rotate through the cases
CASES = [
    (norm, terms, mask, SHAPES[n % len(SHAPES)], IDS[n % len(IDS)])
    for n, (norm, terms, mask) in enumerate(itertools.product(NORMALIZATIONS, TERMS, MASKS))
]


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize(("norm", "terms", "mask", "shape", "ids"), CASES)
def test_kernels_match_the_reference(kernel, norm, terms, mask, shape, ids):
    qkv, params, call = make_case(shape, mask, terms, ids)
    call["normalization"] = norm
    call["scale"] = 0.1 if norm == "exp" else None
    want = outputs_and_grads(reference, qkv, params, call)
    assert_same(outputs_and_grads(KERNELS[kernel], qkv, params, call), want)


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_dropout_masks_are_the_reference_s(kernel):
    qkv, params, call = make_case(SHAPES[0], "causal", "decay+toeplitz_gate", "sorted")
    call.update(dropout_p=0.3, dropout_seed=5)
    want = outputs_and_grads(reference, qkv, params, call)
    assert_same(outputs_and_grads(KERNELS[kernel], qkv, params, call), want)


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_gradcheck_with_documents_and_decay(kernel):
    (q, k, v), _, call = make_case((1, 2, 2, 6, 9), "causal", "decay", "sorted", seed=2)
    log_forget = call.pop("bias").log_forget.detach().requires_grad_()

    def fn(q, k, v, log_forget):
        return KERNELS[kernel](q, k, v, bias=Decay(log_forget), **call)

    assert torch.autograd.gradcheck(fn, (q, k, v, log_forget))


def test_blocks_of_different_documents_are_skipped():
    lk = 64
    ids = torch.arange(lk) // 16  # four documents of 16 tokens, tiles of 8 x 8
    q = k = v = torch.zeros(1, 1, lk, 4, **F64)
    spec = resolve(q, k, v, document_ids=ids, is_causal=True)
    plan, _ = _plan(ForwardArgs.from_spec(spec, 8, 8))
    tiles = list(_tiles(plan))
    assert len(tiles) == 4 * 3  # per document: 2 query blocks x (1 + 2) causal key blocks
    unsorted = resolve(q, k, v, document_ids=torch.arange(lk) % 4)  # interleaved: none skipped
    assert len(list(_tiles(_plan(ForwardArgs.from_spec(unsorted, 8, 8))[0]))) == 8 * 8


@pytest.mark.parametrize(
    "ids,lq,tiles",
    [
        ([0, 1, 2, 0, 1], 2, (1, 2)),  # a document again after others, tiny tiles
        ([0] * 14 + [1] * 355 + [0] * 164, 533, None),  # the same at the default tiles
    ],
)
def test_a_document_in_several_runs_keeps_every_tile_it_meets(ids, lq, tiles):
    """Causal tiles start at Lq - i1, not on the aligned key blocks whose id ranges decide
    which tiles meet a query block's documents: a tile over two aligned blocks is kept where
    either may share (a document whose keys come back after another's lost them before). The
    output and gradients equal the reference's; so does the forward of the raw layer with the
    queries' ids given apart (as `urpe.distributed` hands them over)."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.tensor([ids])
    lk = ids.shape[1]
    q = torch.randn(1, 2, lq, 4, generator=gen, **F64).requires_grad_()
    k, v = (torch.randn(1, 2, lk, 4, generator=gen, **F64).requires_grad_() for _ in range(2))
    bq, bk = tiles or (0, 0)  # (0: the kernel's own tiles)
    inputs = (q, k, v)
    want = attention(*inputs, is_causal=True, document_ids=ids, backend="reference")
    blocks = {} if tiles is None else dict(block_q=bq, block_k=bk)
    got = blockwise_attention(*inputs, is_causal=True, document_ids=ids, **blocks)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    dout = torch.randn(want.shape, generator=gen, **F64)
    for g, w in zip(
        torch.autograd.grad(got, inputs, dout), torch.autograd.grad(want, inputs, dout), strict=True
    ):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12)
    apart = torch.cat([ids[:, lk - lq :], ids], 1)  # (1, Lq + Lk): the queries' ids first
    spec = dataclasses.replace(resolve(q, k, v, is_causal=True), document_ids=apart)
    with torch.no_grad():  # (the raw layer: the custom op's body)
        got = blockwise_forward(ForwardArgs.from_spec(spec, bq, bk))[0].view(want.shape)
        torch.testing.assert_close(got, reference_run(spec), rtol=0, atol=1e-12)


def test_auto_runs_packed_calls_on_a_native_kernel():
    q = torch.randn(1, 2, 16, 8)
    ids = torch.arange(16) // 4
    chosen = select_backend("auto", q, q, q, document_ids=ids).name
    assert chosen in ("cpp", "blockwise")
    chosen = select_backend("auto", q, q, q, bias=Decay(torch.full((1, 2, 16), -0.1))).name
    assert chosen in ("cpp", "blockwise")


@pytest.mark.parametrize("norm", ["softmax"])
def test_sdpa_takes_documents_and_decay_through_its_dense_route(norm):
    qkv, params, call = make_case(SHAPES[0], "causal+padding+bool", "decay", "unsorted")
    want = outputs_and_grads(reference, qkv, params, call)
    sdpa = lambda *a, **c: attention(*a, **c, backend="sdpa")  # noqa: E731
    assert_same(outputs_and_grads(sdpa, qkv, params, call), want)


# FlexAttention: exponential normalisations, no dropout. Its CPU backward is refused by an
# argument check only (see tests/test_flex.py); lifted here so its own backward is compared.
FLEX_CASES = [
    (norm, terms, mask, SHAPES[n % 2], IDS[n % len(IDS)])
    for n, (norm, terms, mask) in enumerate(
        itertools.product(("softmax", "exp", "l2"), ("decay", "decay+toeplitz_gate"), MASKS)
    )
]


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize(("norm", "terms", "mask", "shape", "ids"), FLEX_CASES)
def test_flex_route_matches_the_reference(monkeypatch, norm, terms, mask, shape, ids):
    import torch.nn.attention.flex_attention as flex_module

    from urpe.kernels.flex import flex_urpe_attention

    monkeypatch.setattr(flex_module, "_validate_device", lambda *args: None)
    qkv, params, call = make_case(shape, mask, terms, ids)
    call.pop("enable_gqa")
    call.update(normalization=norm, scale=0.1 if norm == "exp" else None)
    want = outputs_and_grads(lambda *a, **c: reference(*a, **c, enable_gqa=True), qkv, params, call)
    flex = lambda *a, **c: flex_urpe_attention(*a, **c, flex=flex_module.flex_attention)  # noqa: E731
    got = outputs_and_grads(flex, qkv, params, call)
    torch.testing.assert_close(got[0], want[0], atol=1e-12, rtol=1e-10)
    for g, w in zip(got[1], want[1], strict=True):
        torch.testing.assert_close(g, w, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("kernel", ["blockwise", "cpp"])
def test_vmap_and_compile_compose_with_documents_and_decay(kernel):
    if kernel == "cpp" and unavailable() is not None:
        pytest.skip(unavailable())
    (q, k, v), _, call = make_case((3, 2, 2, 7, 7), "causal", "decay", "unsorted", seed=4)
    log_forget, ids = call["bias"].log_forget.detach(), call["document_ids"]

    def one(q, k, v, log_forget, ids):  # one example: (H, L, D), (H, L), (L,)
        return attention(
            q[None],
            k[None],
            v[None],
            bias=Decay(log_forget[None]),
            document_ids=ids[None],
            is_causal=True,
            backend=kernel,
        )[0]

    looped = torch.stack([one(q[i], k[i], v[i], log_forget[i], ids[i]) for i in range(3)])
    mapped = torch.vmap(one)(q, k, v, log_forget, ids)
    torch.testing.assert_close(mapped, looped)
    grad = torch.func.grad(lambda lf: torch.vmap(one)(q, k, v, lf, ids).square().sum())
    leaf = log_forget.clone().requires_grad_()
    stacked = torch.stack([one(q[i], k[i], v[i], leaf[i], ids[i]) for i in range(3)])
    (expected,) = torch.autograd.grad(stacked.square().sum(), leaf)
    torch.testing.assert_close(grad(log_forget), expected)
    compiled = torch.compile(
        lambda q, k, v, lf, ids: attention(
            q, k, v, bias=Decay(lf), document_ids=ids, is_causal=True, backend=kernel
        ),
        fullgraph=True,
        backend="eager",
    )
    torch.testing.assert_close(compiled(q, k, v, log_forget, ids), looped)


class LargestTensor(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the largest tensor any op makes while active (numel)."""

    largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_the_blockwise_kernel_builds_no_length_squared_tensor():
    """Documents and Decay, forward and backward, at L = 2048 on one head: no op makes a tensor
    of even L^2 / 16 entries (the dense mask or bias would be L^2)."""
    from urpe.kernels.blockwise import blockwise_backward, blockwise_forward
    from urpe.kernels.layout import BackwardArgs

    length = 2048
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, length, 8, generator=gen) for _ in "qkv")
    log_forget = torch.nn.functional.logsigmoid(torch.randn(1, 1, length, generator=gen))
    ids = torch.arange(length) // 100
    spec = resolve(
        q, k, v, bias=Decay(log_forget), document_ids=ids, is_causal=True, normalization="relu2"
    )
    args = ForwardArgs.from_spec(spec)
    with LargestTensor() as watch:
        out, stat = blockwise_forward(args)
        blockwise_backward(BackwardArgs(torch.ones_like(out), out, stat, args, True, False, False))
    assert watch.largest < length * length // 16


@pytest.mark.parametrize("norm", ["softmax", "exp", "l2"])
def test_float32_decay_far_into_the_subnormal_range_matches_the_reference(norm):
    """A strong decay puts a band of every row's weights where float32 exp is subnormal, which
    the blockwise kernel flushes to 0 (for speed): the result is still the reference's."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 300, 8, generator=gen).requires_grad_() for _ in "qkv")
    log_forget = torch.full((1, 2, 300), -0.5).requires_grad_()  # e^-0.5 per token: -150 at 300
    call = dict(bias=Decay(log_forget), is_causal=True, normalization=norm)
    params = [q, k, v, log_forget]
    want = outputs_and_grads(
        lambda *a, **c: attention(*a, **c, backend="reference"), (q, k, v), params, call
    )
    got = outputs_and_grads(
        lambda *a, **c: blockwise_attention(*a, **c, block_q=64, block_k=64),
        (q, k, v),
        params,
        call,
    )
    for g, w in zip((got[0], *got[1]), (want[0], *want[1]), strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_queries_before_the_first_key_see_nothing_on_every_kernel(kernel):
    """Lq > Lk: queries at positions < 0 belong to no document (output 0, no gradient)."""
    qkv, params, call = make_case((2, 2, 2, 9, 5), "padding", "decay+toeplitz_gate", "unsorted")
    want = outputs_and_grads(reference, qkv, params, call)
    got = outputs_and_grads(KERNELS[kernel], qkv, params, call)
    assert_same(got, want)
    assert (got[0][:, :, :4] == 0).all()
