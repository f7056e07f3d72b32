"""`urpe.kernels.spec`: `resolve` turns `urpe.attention`'s arguments into one `AttentionSpec`.

Checked here against values worked out independently: leading batch dims flattened (and masks
broadcast over them only where they must be), defaults filled in, structured terms carried as the
objects the caller built, relation indices range-checked, and one clear error per bad argument.
"""

from __future__ import annotations

import math

import pytest
import torch

from urpe.kernels import NORMALIZATIONS, Relation, Toeplitz, resolve

F64 = dict(dtype=torch.float64)


def _qkv(batch=(2, 3), h=4, hkv=None, lq=5, lk=6, d=8, dv=3, dtype=torch.float64):
    hkv = h if hkv is None else hkv
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(*batch, h, lq, d, generator=gen, dtype=dtype)
    k = torch.randn(*batch, hkv, lk, d, generator=gen, dtype=dtype)
    v = torch.randn(*batch, hkv, lk, dv, generator=gen, dtype=dtype)
    return q, k, v


def test_leading_dims_are_flattened_and_restored_by_shape():
    q, k, v = _qkv()
    spec = resolve(q, k, v)
    assert spec.q.shape == (6, 4, 5, 8) and spec.v.shape == (6, 4, 6, 3)
    assert spec.batch_shape == (2, 3)
    assert (spec.batch, spec.heads, spec.lq, spec.lk, spec.head_dim, spec.value_dim) == (
        6,
        4,
        5,
        6,
        8,
        3,
    )
    assert torch.equal(spec.q[4], q[1, 1])  # row-major: (b0, b1) -> b0 * 3 + b1


def test_masks_broadcast_over_the_batch_only_where_they_must():
    q, k, v = _qkv()
    shared = torch.rand(5, 6) < 0.5  # no leading dims: stays one row, no copy
    spec = resolve(q, k, v, attn_mask=shared)
    assert spec.attn_mask.shape == (1, 1, 5, 6)
    assert spec.attn_mask.data_ptr() == shared.data_ptr()
    partial = torch.rand(3, 1, 1, 6) < 0.5  # varies along the second batch dim only
    spec = resolve(q, k, v, attn_mask=partial)
    assert spec.attn_mask.shape == (6, 1, 1, 6)
    for b0 in range(2):
        for b1 in range(3):
            assert torch.equal(spec.attn_mask[b0 * 3 + b1], partial[b1])
    padding = torch.rand(2, 3, 6) < 0.3
    spec = resolve(q, k, v, key_padding_mask=padding)
    assert torch.equal(spec.key_padding_mask, padding.reshape(6, 6))


def test_structured_terms_reach_the_spec_as_the_objects_given():
    q, k, v = _qkv()
    toeplitz = Toeplitz(torch.randn(4, 11, **F64))
    spec = resolve(q, k, v, bias=toeplitz)
    assert spec.bias is toeplitz  # the term object travels as is, no (table, kind) round trip
    index = torch.randint(0, 7, (3, 5, 6), dtype=torch.int32)  # broadcast over the first dim
    spec = resolve(q, k, v, gate=Relation(torch.ones(4, 7, **F64), index))
    assert spec.gate.index.dtype == torch.int64 and spec.gate.index.shape == (6, 5, 6)
    assert torch.equal(spec.gate.index[5], index[2].long())


def test_relation_indices_are_range_checked_naming_the_term():
    q, k, v = _qkv()
    index = torch.zeros(5, 6, dtype=torch.long)
    index[2, 3] = 7
    with pytest.raises(ValueError, match="gate index must lie in \\[0, 7\\).*got 7"):
        resolve(q, k, v, gate=Relation(torch.ones(4, 7, **F64), index))
    with pytest.raises(ValueError, match="bias index must lie in \\[0, 8\\).*got -1"):
        resolve(q, k, v, bias=Relation(torch.ones(4, 8, **F64), index - 1))


def test_defaults_and_scalar_arguments():
    q, k, v = _qkv(d=9)
    spec = resolve(q, k, v)
    assert spec.scale == pytest.approx(1 / 3)
    assert (spec.normalization, spec.is_causal, spec.dropout_p) == ("softmax", False, 0.0)
    assert spec.norm is NORMALIZATIONS["softmax"]
    assert resolve(q, k, v, scale=2).scale == 2.0
    assert resolve(*_qkv(d=0)).scale == 1.0  # no 1 / sqrt(0)
    seed = resolve(q, k, v, dropout_seed=2**62 + 5).dropout_seed
    assert seed.dtype == torch.int64 and seed.dim() == 0 and int(seed) == 5


@pytest.mark.parametrize(
    ("changes", "error", "message"),
    [
        (dict(scale=True), TypeError, "scale must be a float"),
        (dict(scale=math.inf), ValueError, "scale must be finite"),
        (dict(dropout_p=1.5), ValueError, "dropout_p must be in \\[0, 1\\]"),
        (dict(dropout_p=-0.1), ValueError, "dropout_p must be in \\[0, 1\\]"),
        (dict(dropout_p=True), TypeError, "dropout_p must be a float"),
        (dict(is_causal=1), TypeError, "is_causal must be a bool"),
        (dict(normalization="sparsemax"), ValueError, "normalization must be one of.*'relu2'"),
        (dict(dropout_seed=torch.tensor(1.5)), ValueError, "dropout_seed must be an int"),
        (dict(dropout_seed=True), TypeError, "dropout_seed must be an int or a tensor"),
        (dict(attn_mask=torch.ones(5, 6, dtype=torch.long)), TypeError, "attn_mask must be bool"),
        (dict(attn_mask=torch.ones(4, 6).bool()), ValueError, "attn_mask of shape"),
        (dict(key_padding_mask=torch.zeros(2, 3, 6)), TypeError, "key_padding_mask must be a bool"),
        (dict(bias=torch.zeros(5, 6, dtype=torch.long)), TypeError, "bias must be a floating"),
        (dict(gate=Toeplitz(torch.ones(3, 5, **F64))), ValueError, "gate table has 3 heads"),
        (dict(bias=Toeplitz(torch.ones(4, 5))), TypeError, "bias table dtype"),
        (dict(gate="ones"), TypeError, "gate must be a Tensor, urpe.Toeplitz or urpe.Relation"),
    ],
)
def test_each_bad_argument_gets_one_clear_error(changes, error, message):
    with pytest.raises(error, match=message):
        resolve(*_qkv(), **changes)


def test_grouped_queries_need_enable_gqa_and_a_divisor():
    q, k, v = _qkv(h=6, hkv=2)
    with pytest.raises(ValueError, match="enable_gqa=True"):
        resolve(q, k, v)
    spec = resolve(q, k, v, enable_gqa=True)
    assert (spec.heads, spec.kv_heads, spec.groups) == (6, 2, 3)
    q, k, v = _qkv(h=6, hkv=4)
    with pytest.raises(ValueError, match="multiple of"):
        resolve(q, k, v, enable_gqa=True)


def test_half_precision_tables_and_compute_dtype():
    q, k, v = _qkv(dtype=torch.bfloat16)
    spec = resolve(q, k, v, bias=Toeplitz(torch.ones(4, 5)))  # a float32 table may meet bf16
    assert spec.compute_dtype == torch.float32
    assert resolve(*_qkv()).compute_dtype == torch.float64


def test_empty_calls_and_replace():
    assert resolve(*_qkv(lk=0)).is_empty
    assert resolve(*_qkv(batch=(0,))).is_empty
    spec = resolve(*_qkv())
    assert not spec.is_empty
    causal = spec.replace(is_causal=True)
    assert causal.is_causal and not spec.is_causal and causal.q is spec.q
