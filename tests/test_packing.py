"""Packed sequences (`document_ids`) and the decay bias (`urpe.Decay`): the API and the reference.

document_ids must give what the equivalent dense boolean mask gives; `Decay` must give what the
Forgetting Transformer's formula gives (Lin et al., ICLR 2025), transcribed here loop by loop.
The native kernels are checked against the same reference in tests/test_packing_kernels.py.
"""

from __future__ import annotations

import pytest
import torch

import urpe
from urpe.kernels import Decay, Toeplitz, attention, dispatch
from urpe.kernels.masks import visible_key_counts

F64 = dict(dtype=torch.float64)


def fox_bias(log_forget: torch.Tensor, lq: int) -> torch.Tensor:
    """FoX's D_ij = sum_{t=j+1..i} log f_t for j <= i (and the mirrored sum for j > i), written
    as the paper's double loop. log_forget (..., H, Lk) -> (..., H, Lq, Lk); query i sits at
    key position i + Lk - Lq."""
    lk = log_forget.shape[-1]
    out = log_forget.new_zeros(*log_forget.shape[:-1], lq, lk)
    for i in range(lq):
        p = i + lk - lq
        for j in range(lk):
            steps = range(j + 1, p + 1) if j <= p else range(p + 1, j + 1)
            for t in steps:
                out[..., i, j] = out[..., i, j] + log_forget[..., t]
    return out


def fox_attention(q, k, v, log_forget):
    """FoX's causal attention for one head, as the paper writes it:
    o_i = sum_{j<=i} exp(q_i.k_j / sqrt(d) + D_ij) v_j / sum_{j<=i} exp(q_i.k_j / sqrt(d) + D_ij).
    q (Lq, D), k (Lk, D), v (Lk, Dv), log_forget (Lk,)."""
    lq, lk, d = q.shape[0], k.shape[0], q.shape[1]
    rows = []
    for i in range(lq):
        p = i + lk - lq
        weights = []
        for j in range(p + 1):
            decay = sum((log_forget[t] for t in range(j + 1, p + 1)), log_forget.new_zeros(()))
            weights.append(torch.exp(q[i] @ k[j] / d**0.5 + decay))
        total = sum(weights)
        rows.append(sum(w * v[j] for j, w in enumerate(weights)) / total)
    return torch.stack(rows)


def _log_forget(*shape, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.nn.functional.logsigmoid(torch.randn(*shape, generator=gen, **F64) + 1.5)


def _qkv(b, h, lq, lk, d=4, hkv=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, lq, d, generator=gen, **F64)
    k = torch.randn(b, hkv or h, lk, d, generator=gen, **F64)
    v = torch.randn(b, hkv or h, lk, d + 1, generator=gen, **F64)
    return q, k, v


# ---------------------------------------------------------------------------------------------
# Decay


@pytest.mark.parametrize(("lq", "lk"), [(6, 6), (3, 7), (1, 5)])
def test_decay_is_the_fox_formula(lq, lk):
    lf = _log_forget(2, 3, lk)
    torch.testing.assert_close(Decay(lf).dense(lq, lk), fox_bias(lf, lq))


def test_causal_attention_with_decay_is_fox_attention_with_a_cache():
    q, k, v = _qkv(1, 2, 4, 7)
    lf = _log_forget(1, 2, 7)
    out = attention(q, k, v, bias=Decay(lf), is_causal=True, backend="reference")
    for h in range(2):
        want = fox_attention(q[0, h], k[0, h], v[0, h], lf[0, h])
        torch.testing.assert_close(out[0, h], want)


@pytest.mark.parametrize("backend", ["reference", "sdpa"])
def test_decay_gradients_pass_gradcheck(backend):
    q, k, v = (t.requires_grad_() for t in _qkv(1, 2, 5, 5, d=3))
    lf = _log_forget(1, 2, 5).requires_grad_()

    def call(q, k, v, lf):
        return attention(q, k, v, bias=Decay(lf), is_causal=True, backend=backend)

    assert torch.autograd.gradcheck(call, (q, k, v, lf))


def test_decay_heads_broadcast_and_batch_dims():
    q, k, v = _qkv(2, 3, 5, 5)
    lf = _log_forget(1, 5)  # one row shared by every batch and head
    out = attention(q, k, v, bias=Decay(lf), backend="reference")
    dense = fox_bias(lf, 5)  # (1, Lq, Lk)
    torch.testing.assert_close(out, attention(q, k, v, bias=dense, backend="reference"))
    q4, k4, v4 = (t.reshape(1, 2, *t.shape[1:]) for t in (q, k, v))  # leading dims (1, 2)
    lf4 = _log_forget(2, 3, 5)
    out4 = attention(q4, k4, v4, bias=Decay(lf4), backend="reference")
    want = attention(q4, k4, v4, bias=fox_bias(lf4, 5), backend="reference")
    torch.testing.assert_close(out4, want)


@pytest.mark.parametrize(
    ("values", "error"),
    [(0.5, "must be <= 0"), (float("nan"), "must be <= 0"), (float("-inf"), "must be finite")],
)
def test_decay_rejects_positive_and_non_finite_values(values, error):
    q, k, v = _qkv(1, 2, 4, 4)
    lf = _log_forget(1, 2, 4)
    lf[0, 1, 2] = values
    with pytest.raises(ValueError, match=error):
        attention(q, k, v, bias=Decay(lf))
    good = _log_forget(1, 2, 4)
    attention(q, k, v, bias=Decay(good))  # remembered: the next call takes the plan's path
    with pytest.raises(ValueError, match=error):
        attention(q, k, v, bias=Decay(lf))


def test_decay_shape_and_place_errors():
    q, k, v = _qkv(1, 2, 4, 4)
    with pytest.raises(ValueError, match="log_forget must have shape"):
        attention(q, k, v, bias=Decay(_log_forget(1, 2, 3)))
    with pytest.raises(ValueError, match="log_forget must have shape"):
        attention(q, k, v, bias=Decay(_log_forget(1, 3, 4)))
    with pytest.raises(TypeError, match="pass it as bias="):
        attention(q, k, v, gate=Decay(_log_forget(1, 2, 4)))
    with pytest.raises(TypeError, match="floating point"):
        Decay(torch.zeros(2, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"\(\.\.\., H, Lk\)"):
        Decay(torch.zeros(4, **F64))


def test_decay_combines_with_a_toeplitz_gate_and_every_normalisation():
    q, k, v = _qkv(2, 2, 6, 6)
    lf = _log_forget(2, 2, 6)
    gate = Toeplitz(torch.rand(2, 5, **F64) + 0.5)
    for norm in urpe.kernels.NORMALIZATIONS:
        got = attention(q, k, v, bias=Decay(lf), gate=gate, normalization=norm, scale=0.3)
        want = attention(
            q,
            k,
            v,
            bias=fox_bias(lf, 6),
            gate=gate,
            normalization=norm,
            scale=0.3,
            backend="reference",
        )
        torch.testing.assert_close(got, want)


# ---------------------------------------------------------------------------------------------
# document_ids


def document_mask(ids: torch.Tensor, lq: int) -> torch.Tensor:
    """The dense mask document_ids stands for, by a loop: (..., Lk) -> (..., 1, Lq, Lk)."""
    lk = ids.shape[-1]
    keep = torch.zeros(*ids.shape[:-1], lq, lk, dtype=torch.bool)
    for i in range(lq):
        p = i + lk - lq
        for j in range(lk):
            keep[..., i, j] = (ids[..., p] == ids[..., j]) if p >= 0 else False
    return keep.unsqueeze(-3)


IDS = {
    "sorted": torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2], [4, 4, 4, 4, 4, 7, 7, 9, 9]]),
    "unsorted": torch.tensor([[3, 1, 3, 1, 1, 2, 3, 2, 1], [0, 5, 0, 5, 5, 0, 5, 5, 0]]),
    "length one": torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 8], [0, 0, 1, 2, 2, 2, 3, 4, 4]]),
}


@pytest.mark.parametrize("ids", list(IDS))
@pytest.mark.parametrize("norm", list(urpe.kernels.NORMALIZATIONS))
@pytest.mark.parametrize(("lq", "causal"), [(9, False), (9, True), (4, True), (4, False)])
def test_document_ids_equal_the_dense_mask(ids, norm, lq, causal):
    ids = IDS[ids]
    q, k, v = _qkv(2, 4, lq, 9, hkv=2)
    padding = torch.zeros(2, 9, dtype=torch.bool)
    padding[1, 3] = True
    call = dict(
        is_causal=causal,
        key_padding_mask=padding,
        normalization=norm,
        scale=0.4,
        enable_gqa=True,
        backend="reference",
    )
    got = attention(q, k, v, document_ids=ids, **call)
    want = attention(q, k, v, attn_mask=document_mask(ids, lq), **call)
    torch.testing.assert_close(got, want)


def test_document_ids_broadcast_combine_with_a_mask_and_dropout():
    q, k, v = _qkv(2, 2, 9, 9)
    ids = IDS["unsorted"][0]  # (Lk,): shared by the batch
    mask = torch.rand(9, 9, generator=torch.Generator().manual_seed(3)) > 0.3
    call = dict(dropout_p=0.3, dropout_seed=11, backend="reference")
    got = attention(q, k, v, document_ids=ids, attn_mask=mask, **call)
    want = attention(q, k, v, attn_mask=mask & document_mask(ids, 9), **call)
    torch.testing.assert_close(got, want)


def test_queries_before_the_first_key_see_nothing():
    q, k, v = _qkv(1, 1, 5, 3)
    out = attention(q, k, v, document_ids=torch.tensor([0, 0, 1]), backend="reference")
    assert (out[0, 0, :2] == 0).all()
    assert (out[0, 0, 2:] != 0).all()


def test_document_ids_errors():
    q, k, v = _qkv(1, 2, 4, 4)
    with pytest.raises(TypeError, match="integer Tensor"):
        attention(q, k, v, document_ids=torch.zeros(4))
    with pytest.raises(TypeError, match="integer Tensor"):
        attention(q, k, v, document_ids=torch.zeros(4, dtype=torch.bool))
    with pytest.raises(ValueError, match="document_ids"):
        attention(q, k, v, document_ids=torch.zeros(5, dtype=torch.int64))


def test_a_nan_in_another_document_never_reaches_a_query():
    q, k, v = _qkv(1, 1, 6, 6)
    v[0, 0, 0] = float("nan")
    ids = torch.tensor([0, 0, 1, 1, 1, 1])
    for backend in ("reference", "auto"):
        out = attention(q, k, v, document_ids=ids, backend=backend)
        assert out[0, 0, :2].isnan().all() and torch.isfinite(out[0, 0, 2:]).all()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lq", [7, 3, 9])
def test_visible_key_counts_with_documents_build_no_matrix_and_match_it(causal, lq):
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 3, (2, 7), generator=gen)
    padding = torch.rand(2, 7, generator=gen) < 0.3
    flags = torch.rand(2, 3, 7, generator=gen) < 0.6
    got = visible_key_counts(padding, None, causal, lq, 7, key_flags=flags, document_ids=ids)
    keep = document_mask(ids, lq) & ~padding[:, None, None, :] & flags[:, :, None, :]
    if causal:
        keep = keep & urpe.kernels.causal_keep(lq, 7)
    assert torch.equal(got, keep.sum(-1))


def test_remembered_calls_tell_documents_and_decay_apart():
    dispatch.CALLS.clear()
    q, k, v = _qkv(1, 2, 6, 6)
    ids = torch.tensor([0, 0, 0, 1, 1, 1])
    lf = _log_forget(1, 2, 6)
    for _ in range(2):  # the second round takes the remembered plans
        plain = attention(q, k, v)
        packed = attention(q, k, v, document_ids=ids)
        decayed = attention(q, k, v, bias=Decay(lf))
        decayed_shared = attention(q, k, v, bias=Decay(lf[:, :1]))
        torch.testing.assert_close(plain, attention(q, k, v, backend="reference"))
        want = attention(q, k, v, attn_mask=document_mask(ids, 6), backend="reference")
        torch.testing.assert_close(packed, want)
        want = attention(q, k, v, bias=fox_bias(lf, 6), backend="reference")
        torch.testing.assert_close(decayed, want)
        want = attention(q, k, v, bias=fox_bias(lf[:, :1], 6), backend="reference")
        torch.testing.assert_close(decayed_shared, want)
