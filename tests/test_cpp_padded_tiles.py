"""Packed rows with a padded tail on the C++ kernel, against the reference in float64: outputs and
the gradients of q, k, v and of every term. The kernel skips tiles whose keys are all padded
or whose queries' documents hold no visible key, and splits a query block into groups of 16
queries where its documents are short runs (padding with one id per token); tile sizes here
make every kind of tile occur: all padded, partly padded, split into groups and whole."""

from __future__ import annotations

import itertools

import pytest
import torch

from urpe.kernels import NORMALIZATIONS, Decay, Relation, Toeplitz, attention
from urpe.kernels.cpp import cpp_attention, unavailable

pytestmark = pytest.mark.skipif(unavailable() is not None, reason="no C++ kernel")

F64 = dict(dtype=torch.float64)
# (B, H, Hkv, Lq, Lk, real tokens per row): grouped queries, a cache (Lq < Lk), rows of
# different real lengths
SHAPES = ((2, 2, 1, 70, 70, (20, 33)), (1, 2, 2, 40, 75, (50,)), (2, 4, 2, 48, 48, (7, 48)))
# how the tail is hidden: key padding alone; key padding and a document of its own; one
# document per padded token (no padding mask); both
TAILS = ("padding", "padding_document", "distinct_ids", "distinct_ids+padding")
TERMS = ("toeplitz+toeplitz_gate", "relation_gate", "decay+toeplitz_gate", "dense_gate")
TILES = ((4, 8), (32, 8), (0, 0))  # (0, 0): the kernel's own


def tail_case(shape, tail, terms, causal, seed=0):
    b, h, hkv, lq, lk, real = shape
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, lq, 8, generator=gen, **F64).requires_grad_()
    k = torch.randn(b, hkv, lk, 8, generator=gen, **F64).requires_grad_()
    v = torch.randn(b, hkv, lk, 5, generator=gen, **F64).requires_grad_()
    params = [q, k, v]
    lengths = torch.tensor(real if len(real) == b else real * b)[:, None]  # (B, 1)
    padded = torch.arange(lk) >= lengths  # (B, Lk)
    call = dict(is_causal=causal, enable_gqa=True)
    if "padding" in tail:
        call["key_padding_mask"] = padded
    if tail == "padding_document":  # documents of 9 tokens, the tail one more
        call["document_ids"] = torch.where(padded, 1000, torch.arange(lk) // 9)
    if tail.startswith("distinct_ids"):
        call["document_ids"] = torch.where(padded, 1000 + torch.arange(lk), torch.arange(lk) // 9)
    if terms.startswith("toeplitz"):
        call["bias"] = Toeplitz(torch.randn(h, 11, generator=gen, **F64).requires_grad_())
    if terms.startswith("decay"):
        raw = torch.randn(b, h, lk, generator=gen, **F64)
        call["bias"] = Decay(torch.nn.functional.logsigmoid(raw + 1).requires_grad_())
    if "toeplitz_gate" in terms:
        call["gate"] = Toeplitz((torch.rand(h, 9, generator=gen, **F64) + 0.5).requires_grad_())
    if terms == "relation_gate":
        table = (torch.rand(h, 4, generator=gen, **F64) + 0.5).requires_grad_()
        call["gate"] = Relation(table, torch.randint(0, 4, (b, lq, lk), generator=gen))
    if terms == "dense_gate":
        call["gate"] = torch.rand(b, h, lq, lk, generator=gen, **F64).requires_grad_()
    for name in ("bias", "gate"):
        term = call.get(name)
        if term is None:
            continue
        leaf = term if isinstance(term, torch.Tensor) else next(iter(vars(term).values()))
        params.append(leaf)
    return (q, k, v), params, call


def reference(*qkv, **call):
    return attention(*qkv, **call, backend="reference")


def outputs_and_grads(fn, qkv, params, call):
    out = fn(*qkv, **call)
    weight = torch.linspace(-1, 1, out.numel(), **F64).view_as(out)
    return out, torch.autograd.grad((out * weight).sum(), params)


def assert_same(got, want):
    torch.testing.assert_close(got[0], want[0], atol=1e-10, rtol=1e-8)
    for n, (g, w) in enumerate(zip(got[1], want[1], strict=True)):
        torch.testing.assert_close(g, w, atol=1e-10, rtol=1e-8, msg=lambda m, n=n: f"grad {n}: {m}")


# every normalisation x tail x terms once; shapes, causality and tiles rotate through the cases
CASES = [
    (norm, tail, terms, SHAPES[n % len(SHAPES)], n % 2 == 1, TILES[n % len(TILES)])
    for n, (norm, tail, terms) in enumerate(itertools.product(NORMALIZATIONS, TAILS, TERMS))
]


@pytest.mark.parametrize(("norm", "tail", "terms", "shape", "causal", "tiles"), CASES)
def test_padded_tails_match_the_reference(norm, tail, terms, shape, causal, tiles):
    qkv, params, call = tail_case(shape, tail, terms, causal)
    call["normalization"] = norm
    call["scale"] = 0.1 if norm == "exp" else None
    want = outputs_and_grads(reference, qkv, params, call)
    block_q, block_k = tiles
    got = outputs_and_grads(
        lambda *a, **c: cpp_attention(*a, **c, block_q=block_q, block_k=block_k), qkv, params, call
    )
    assert_same(got, want)


def test_the_term_leaves_are_the_parameters():
    """The case builder hands every term's leaf to the gradient check (none left out)."""
    _, params, _ = tail_case(SHAPES[0], "padding", "decay+toeplitz_gate", False)
    assert len(params) == 5 and all(p.requires_grad for p in params)


@pytest.mark.parametrize("tail", ["padding_document", "distinct_ids"])
def test_dropout_with_a_padded_tail_is_the_reference_s(tail):
    qkv, params, call = tail_case(SHAPES[0], tail, "toeplitz+toeplitz_gate", True)
    call.update(dropout_p=0.3, dropout_seed=5)
    want = outputs_and_grads(reference, qkv, params, call)
    assert_same(outputs_and_grads(cpp_attention, qkv, params, call), want)


def test_documents_that_are_not_runs_read_every_key():
    """Ids that come back after another document (not runs): no group or span narrowing."""
    qkv, params, call = tail_case(SHAPES[0], "distinct_ids", "relation_gate", False)
    ids = call["document_ids"].clone()
    ids[:, -3:] = ids[:, :3]  # the first tokens' documents again at the end
    call["document_ids"] = ids
    want = outputs_and_grads(reference, qkv, params, call)
    assert_same(outputs_and_grads(cpp_attention, qkv, params, call), want)


@pytest.mark.parametrize("tiles", [(4, 8), (32, 16)])
@pytest.mark.parametrize("tail", ["distinct_ids", "distinct_ids+padding"])
def test_bfloat16_products_by_runs_are_the_reference_s(tail, tiles):
    """bfloat16 operands through the products that run query by query over short documents
    (tiles of 4 queries, and groups of 16 split from blocks of 32), forward and backward:
    within bfloat16's rounding of A and dS of the reference on the same numbers in float64."""
    (q, k, v), _, call = tail_case(SHAPES[0], tail, "relation_gate", True)
    table, index = call["gate"].table, call["gate"].index

    def run(fn, dtype, term_dtype):
        # the same numbers for both: q, k, v rounded to bfloat16, the table to float32
        qkv = [t.detach().bfloat16().to(dtype).requires_grad_() for t in (q, k, v)]
        gate_table = table.detach().float().to(term_dtype).requires_grad_()
        here = dict(call, gate=Relation(gate_table, index))
        out, grads = outputs_and_grads(fn, qkv, [*qkv, gate_table], here)
        return out.double(), [g.double() for g in grads]

    want = run(reference, torch.float64, torch.float64)
    block_q, block_k = tiles
    got = run(
        lambda *a, **c: cpp_attention(*a, **c, block_q=block_q, block_k=block_k),
        torch.bfloat16,
        torch.float32,
    )
    torch.testing.assert_close(got[0], want[0], atol=2e-2, rtol=2e-2)
    for g, w in zip(got[1], want[1], strict=True):
        torch.testing.assert_close(g, w, atol=3e-2, rtol=3e-2)


def short_documents_case(norm, causal, dtype, seed=1):
    """One row of 37 tokens in documents of 1, 2, 3 and 5 tokens (queries that see 1-3 keys run
    their row loops key by key, longer ones in blocks of 16), a few keys padded inside them,
    Toeplitz bias and gate: the reference's inputs in float64, the kernel's in `dtype`."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [1, 2, 3, 5] * 4
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[:37]
    ids = torch.cat([ids, torch.full((37 - len(ids),), 99)])  # (37,)
    padded = torch.zeros(1, 37, dtype=torch.bool)
    padded[0, [4, 12, 30]] = True
    qkv = [torch.randn(1, 2, 37, 8, generator=gen, **F64) for _ in range(3)]
    bias = torch.randn(2, 11, generator=gen, **F64)
    gate = torch.rand(2, 9, generator=gen, **F64) + 0.5

    def inputs(kind):
        leaves = [t.to(kind).requires_grad_() for t in (*qkv, bias, gate)]
        call = dict(
            is_causal=causal,
            document_ids=ids[None],
            key_padding_mask=padded,
            bias=Toeplitz(leaves[3]),
            gate=Toeplitz(leaves[4]),
            normalization=norm,
            scale=0.1 if norm == "exp" else None,
        )
        return leaves[:3], leaves, call

    return inputs(torch.float64), inputs(dtype)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("norm", NORMALIZATIONS)
def test_rows_that_see_few_keys_are_the_reference_s(norm, causal):
    """Rows of 1-3 visible keys (loops key by key) beside longer ones, forward and backward, in
    float64 and float32, with tiles of 4 queries (by runs) and the kernel's own."""
    (qkv, params, call), (qkv32, params32, call32) = short_documents_case(
        norm, causal, torch.float32
    )
    want = outputs_and_grads(reference, qkv, params, call)
    for block_q, block_k in ((4, 8), (0, 0)):

        def fn(*a, block_q=block_q, block_k=block_k, **c):
            return cpp_attention(*a, **c, block_q=block_q, block_k=block_k)

        assert_same(outputs_and_grads(fn, qkv, params, call), want)
        out, grads = outputs_and_grads(fn, qkv32, params32, call32)
        torch.testing.assert_close(out.double(), want[0], atol=2e-5, rtol=2e-4)
        for g, w in zip(grads, want[1], strict=True):
            torch.testing.assert_close(g.double(), w, atol=2e-4, rtol=2e-3)


def short_runs_case(norm, causal, masks, seed=2):
    """Every query in a document of 1-3 tokens (after 8 tokens of longer ones), so that groups of
    16 split from blocks of 32, and tiles of 4 queries, run each row by its few own keys alone
    (short_runs.h), here beside key padding, a boolean or float attn_mask, dropout and a dense
    bias, in float64."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [4, 4] + [1, 3, 2, 1, 1, 2, 3] * 6
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[:80]
    qkv = [torch.randn(2, 2, 80, 8, generator=gen, **F64).requires_grad_() for _ in range(3)]
    bias = torch.randn(2, 1, 80, 80, generator=gen, **F64).requires_grad_()
    gate = (torch.rand(2, 2 * 80 - 1, generator=gen, **F64) + 0.5).requires_grad_()
    call = dict(
        is_causal=causal,
        document_ids=ids[None].expand(2, 80),
        bias=bias,
        gate=Toeplitz(gate),
        normalization=norm,
        scale=0.1 if norm == "exp" else None,
    )
    if "padding" in masks:
        call["key_padding_mask"] = torch.rand(2, 80, generator=gen) < 0.2
    if "bool" in masks:
        call["attn_mask"] = torch.rand(80, 80, generator=gen) < 0.7
    if "float" in masks:
        call["attn_mask"] = torch.randn(2, 2, 80, 80, generator=gen, **F64)
    if "dropout" in masks:
        call.update(dropout_p=0.25, dropout_seed=3)
    return qkv, [*qkv, bias, gate], call


@pytest.mark.parametrize("masks", ["padding+bool+dropout", "float", "padding"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("norm", NORMALIZATIONS)
def test_rows_of_short_documents_run_by_their_own_keys_as_the_reference(norm, causal, masks):
    qkv, params, call = short_runs_case(norm, causal, masks)
    want = outputs_and_grads(reference, qkv, params, call)
    for block_q, block_k in ((32, 16), (4, 8), (0, 0)):
        got = outputs_and_grads(
            lambda *a, bq=block_q, bk=block_k, **c: cpp_attention(*a, **c, block_q=bq, block_k=bk),
            qkv,
            params,
            call,
        )
        assert_same(got, want)


def test_a_nan_in_a_short_document_reaches_its_own_queries_alone():
    """One id per padded token: a NaN key in the padded tail reaches its own query's output and
    gradients (it sees that key), and no other row's, without gradients (the loop's own check of
    the rows it reads) and with them."""
    qkv, params, call = tail_case(SHAPES[2], "distinct_ids", "toeplitz+toeplitz_gate", False)
    with torch.no_grad():
        qkv[1][0, 1, 30, 3] = float("nan")  # row 0's tail starts at 7: key 30 is padded
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            got = cpp_attention(*qkv, **call, block_q=32, block_k=16)
            want = reference(*qkv, **call)
        torch.testing.assert_close(got, want, equal_nan=True, atol=1e-10, rtol=1e-8)
        nan_rows = got.isnan().any(-1).nonzero().tolist()
        assert nan_rows == [[0, 2, 30], [0, 3, 30]]  # the query heads of kv head 1
    got = outputs_and_grads(cpp_attention, qkv, params, call)
    want = outputs_and_grads(reference, qkv, params, call)
    for g, w in zip((got[0], *got[1][:3]), (want[0], *want[1][:3]), strict=True):
        torch.testing.assert_close(g, w, equal_nan=True, atol=1e-10, rtol=1e-8)
