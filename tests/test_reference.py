"""The reference kernel against the loop-by-loop statement in tests/naive.py, and its gradients."""

import itertools

import pytest
import torch

import urpe
from urpe.kernels import BACKENDS, NORMALIZATIONS, reference_attention

from .naive import naive_attention, toeplitz_by_hand

NORMS = ["softmax", "exp", "l2", "relu2"]  # the ones tests/naive.py states independently
F64 = dict(dtype=torch.float64)


def qkv(b=2, h=3, lq=5, lk=5, d=4, dv=3, requires_grad=False):
    q = torch.randn(b, h, lq, d, **F64, requires_grad=requires_grad)
    k = torch.randn(b, h, lk, d, **F64, requires_grad=requires_grad)
    v = torch.randn(b, h, lk, dv, **F64, requires_grad=requires_grad)
    return q, k, v


def padding_for(b, lk):
    mask = torch.zeros(b, lk, dtype=torch.bool)
    mask[-1, lk - 2 :] = True  # last row: two padded keys
    return mask


@pytest.mark.parametrize(
    "norm,causal,lq,lk,term",
    [
        (n, c, lq, lk, t)
        for n, c, (lq, lk), t in itertools.product(
            NORMS, [False, True], [(5, 5), (3, 6)], ["dense", "toeplitz", "relation"]
        )
    ],
)
def test_reference_matches_naive(norm, causal, lq, lk, term):
    b, h = 2, 3
    q, k, v = qkv(b, h, lq, lk)
    padding = padding_for(b, lk)
    if term == "dense":
        bias_arg = torch.randn(b, h, lq, lk, **F64)
        gate_arg = torch.rand(1, h, lq, lk, **F64) + 0.5
        bias_dense, gate_dense = bias_arg, gate_arg
    elif term == "toeplitz":
        bt, gt = torch.randn(h, 5, **F64), torch.rand(h, 3, **F64) + 0.5  # K = 2 and 1: clipping
        bias_arg, gate_arg = urpe.Toeplitz(bt), urpe.Toeplitz(gt)
        bias_dense, gate_dense = toeplitz_by_hand(bt, lq, lk), toeplitz_by_hand(gt, lq, lk)
    else:
        bt, gt = torch.randn(h, 4, **F64), torch.rand(h, 4, **F64) + 0.5
        index = torch.randint(0, 4, (b, lq, lk))
        bias_arg, gate_arg = urpe.Relation(bt, index), urpe.Relation(gt, index)
        bias_dense = torch.stack([bt[:, index[i]] for i in range(b)])
        gate_dense = torch.stack([gt[:, index[i]] for i in range(b)])
    got = reference_attention(
        q,
        k,
        v,
        bias=bias_arg,
        gate=gate_arg,
        key_padding_mask=padding,
        is_causal=causal,
        normalization=norm,
    )
    want = naive_attention(q, k, v, bias_dense, gate_dense, padding, causal, norm)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("norm", NORMS)
def test_reference_gradcheck(norm):
    b, h, lq, lk = 2, 2, 3, 4
    q, k, v = qkv(b, h, lq, lk, d=3, dv=2, requires_grad=True)
    bias_table = torch.randn(h, 5, **F64, requires_grad=True)
    gate_table = (torch.rand(h, 5, **F64) + 0.5).requires_grad_()
    dense_bias = torch.randn(1, h, lq, lk, **F64, requires_grad=True)
    dense_gate = (torch.rand(b, 1, lq, lk, **F64) + 0.5).requires_grad_()
    padding = torch.tensor([[False, False, False, False], [False, False, True, True]])

    def toeplitz(q, k, v, bias_table, gate_table):
        return reference_attention(
            q,
            k,
            v,
            bias=urpe.Toeplitz(bias_table),
            gate=urpe.Toeplitz(gate_table),
            key_padding_mask=padding,
            is_causal=True,
            normalization=norm,
        )

    def dense(q, k, v, dense_bias, dense_gate):
        return reference_attention(
            q,
            k,
            v,
            bias=dense_bias,
            gate=dense_gate,
            key_padding_mask=padding,
            normalization=norm,
        )

    if norm == "relu2":  # relu is not differentiable at 0; keep logits away from it
        q = (q.detach() * 3).requires_grad_()
    assert torch.autograd.gradcheck(toeplitz, (q, k, v, bias_table, gate_table))
    assert torch.autograd.gradcheck(dense, (q, k, v, dense_bias, dense_gate))


def test_structured_terms_equal_their_dense_expansion():
    q, k, v = qkv(2, 3, 4, 7)
    table = torch.randn(3, 5, **F64)
    index = torch.randint(0, 6, (2, 4, 7))
    rel_table = torch.randn(3, 6, **F64)
    for term in (urpe.Toeplitz(table), urpe.Relation(rel_table, index)):
        dense = term.dense(4, 7)
        for role in ("bias", "gate"):
            a = urpe.attention(q, k, v, **{role: term}, backend="reference")
            b = urpe.attention(q, k, v, **{role: dense}, backend="reference")
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(urpe.Toeplitz(table).dense(4, 7), toeplitz_by_hand(table, 4, 7))


def test_toeplitz_offsets_beyond_table_reuse_edges():
    table = torch.arange(5.0)[None]  # offsets -2..2 -> 0..4
    dense = urpe.Toeplitz(table).dense(6, 6)[0, 0]
    assert dense[0, 5] == 4 and dense[5, 0] == 0 and dense[3, 3] == 2 and dense[2, 3] == 3


def test_masked_keys_get_exactly_zero_and_empty_rows_return_zero():
    q, k, v = qkv(2, 2, 4, 4)
    padding = torch.tensor([[False, True, False, True], [True, True, True, True]])
    gate = torch.ones(2, 1, 4, 4, **F64)
    gate[padding[:, None, None, :].expand_as(gate)] = float("inf")  # poison on hidden keys only
    for norm in NORMS:
        w = urpe.kernels.reference_weights(q, k, key_padding_mask=padding, normalization=norm)
        assert (w[0, :, :, 1] == 0).all() and (w[0, :, :, 3] == 0).all()
        out = urpe.attention(q, k, v, key_padding_mask=padding, normalization=norm)
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        assert torch.isfinite(out).all()
        gated = urpe.attention(q, k, v, gate=gate, key_padding_mask=padding, normalization=norm)
        assert torch.equal(gated[1], torch.zeros_like(gated[1]))
        torch.testing.assert_close(gated, out)
    # Gradients through a fully masked row are zeros, not NaN.
    q.requires_grad_()
    urpe.attention(q, k, v, key_padding_mask=padding).sum().backward()
    assert torch.isfinite(q.grad).all() and torch.equal(q.grad[1], torch.zeros_like(q.grad[1]))


def test_rows_sum_to_one_only_where_the_registry_says_so():
    q, k, _ = qkv(1, 2, 6, 6)
    for name, norm in NORMALIZATIONS.items():
        rows = urpe.kernels.reference_weights(q, k, normalization=name).sum(-1)
        assert torch.allclose(rows, torch.ones_like(rows)) == norm.rows_sum_to_one, name


def test_l2_is_stable_for_large_logits():
    q, k, v = qkv(1, 1, 4, 4)
    out = urpe.attention(q * 300, k * 300, v, normalization="l2", backend="reference")
    assert torch.isfinite(out).all()


def test_causal_queries_align_to_the_last_keys():
    q, k, v = qkv(1, 1, 2, 5)
    w = urpe.kernels.reference_weights(q, k, is_causal=True)
    assert (w[0, 0, 0, 4] == 0) and (w[0, 0, 0, :4] > 0).all() and (w[0, 0, 1] > 0).all()


def test_padding_appended_changes_nothing():
    b, h, length, extra = 2, 2, 5, 3
    q, k, v = qkv(b, h, length + extra, length + extra)
    bias = torch.randn(b, h, length + extra, length + extra, **F64)
    gate = torch.rand(b, h, length + extra, length + extra, **F64)
    padding = torch.zeros(b, length + extra, dtype=torch.bool)
    padding[:, length:] = True
    for norm in NORMS:
        short = urpe.attention(
            q[:, :, :length],
            k[:, :, :length],
            v[:, :, :length],
            bias=bias[..., :length, :length],
            gate=gate[..., :length, :length],
            normalization=norm,
        )
        long = urpe.attention(
            q, k, v, bias=bias, gate=gate, key_padding_mask=padding, normalization=norm
        )
        torch.testing.assert_close(long[:, :, :length], short, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dropout_zeroes_weights_and_rescales(p):
    q, k, v = qkv(2, 2, 64, 64)
    w = urpe.kernels.reference_weights(q, k)
    dropped = urpe.kernels.reference_weights(q, k, dropout_p=p, dropout_seed=3)
    kept = dropped != 0
    # every kept weight is scaled by exactly 1 / (1 - p); the others are 0
    torch.testing.assert_close(dropped[kept], w[kept] / (1 - p), rtol=1e-15, atol=0)
    rate = 1 - kept.double().mean().item()
    assert abs(rate - p) < 4 * (p * (1 - p) / kept.numel()) ** 0.5 + 1e-3, rate
    # the expectation is preserved: averaged over seeds, the weights come back
    mean = (
        sum(urpe.kernels.reference_weights(q, k, dropout_p=p, dropout_seed=s) for s in range(200))
        / 200
    )
    torch.testing.assert_close(mean.mean(-1), w.mean(-1), rtol=0.1 if p < 0.9 else 0.3, atol=0)


def test_dropout_masks_follow_the_seed():
    q, k, _ = qkv(1, 2, 16, 16)
    first = urpe.kernels.reference_weights(q, k, dropout_p=0.3, dropout_seed=1)
    again = urpe.kernels.reference_weights(q, k, dropout_p=0.3, dropout_seed=torch.tensor(1))
    other = urpe.kernels.reference_weights(q, k, dropout_p=0.3, dropout_seed=2)
    assert torch.equal(first, again) and not torch.equal(first, other)
    torch.manual_seed(7)
    drawn = urpe.kernels.reference_weights(q, k, dropout_p=0.3)
    torch.manual_seed(7)
    assert torch.equal(drawn, urpe.kernels.reference_weights(q, k, dropout_p=0.3))


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("hkv", [1, 3])
def test_reference_with_bool_mask_and_grouped_queries_matches_naive(norm, hkv):
    b, h, lq, lk = 2, 6, 4, 7
    q = torch.randn(b, h, lq, 4, **F64)
    k, v = torch.randn(b, hkv, lk, 4, **F64), torch.randn(b, hkv, lk, 3, **F64)
    visible = torch.rand(b, 1, lq, lk) < 0.6
    visible[0, 0, 1] = False  # a row with nothing visible
    bias = urpe.Toeplitz(torch.randn(h, 5, **F64))
    gate = torch.rand(1, h, lq, lk, **F64) + 0.5
    padding = padding_for(b, lk)
    got = reference_attention(
        q,
        k,
        v,
        visible,
        bias=bias,
        gate=gate,
        key_padding_mask=padding,
        is_causal=True,
        normalization=norm,
        enable_gqa=True,
    )
    want = naive_attention(q, k, v, bias.dense(lq, lk), gate, padding, True, norm, visible)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("norm", NORMS)
def test_half_precision_computes_in_float32(norm):
    q, k, v = qkv(1, 2, 6, 6)
    bias = urpe.Toeplitz(torch.randn(2, 3, **F64))
    want = reference_attention(q, k, v, bias=bias, normalization=norm, is_causal=True)
    for dtype in (torch.bfloat16, torch.float16):
        got = reference_attention(
            q.to(dtype),
            k.to(dtype),
            v.to(dtype),
            bias=urpe.Toeplitz(bias.table.to(dtype)),
            normalization=norm,
            is_causal=True,
        )
        assert got.dtype == dtype
        torch.testing.assert_close(got.double(), want, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lq,lk", [(5, 5), (3, 7), (7, 7)])
def test_sdpa_backend_matches_reference(causal, lq, lk):
    q, k, v = qkv(2, 3, lq, lk)
    padding = padding_for(2, lk)
    for bias in (None, torch.randn(2, 3, lq, lk, **F64), urpe.Toeplitz(torch.randn(3, 5, **F64))):
        for mask in (None, padding):
            got = urpe.attention(
                q, k, v, bias=bias, key_padding_mask=mask, is_causal=causal, backend="sdpa"
            )
            want = urpe.attention(
                q, k, v, bias=bias, key_padding_mask=mask, is_causal=causal, backend="reference"
            )
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_backend_selection():
    q, k, v = qkv()
    assert (
        urpe.kernels.select_backend("auto", q=q, k=k, v=v, gate=None, normalization="softmax").name
        != "reference"
    )
    with pytest.raises(ValueError, match="backend 'sdpa' cannot run"):
        urpe.attention(q, k, v, gate=torch.ones(1, 1, 5, 5, **F64), backend="sdpa")
    with pytest.raises(ValueError, match="backend must be"):
        urpe.attention(q, k, v, backend="nope")
    assert "reference" in BACKENDS and "sdpa" in BACKENDS
