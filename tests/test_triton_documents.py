"""Packed documents (`document_ids`) and the `Decay` bias on the Triton kernel, forward and every
gradient, against the reference on an independently built dense mask and dense bias (float64).

Under Triton's interpreter (no GPU) with its 16 x 16 tiles, so every shape spans several query
and key tiles: tiles that share no document are skipped, the rest compare ids pair by pair.
"""

from __future__ import annotations

import pytest
import torch

from urpe.kernels import (
    Decay,
    Relation,
    Toeplitz,
    attention,
    reference_attention,
    reference_weights,
)
from urpe.kernels.triton import dropout_keep_mask, triton_attention, triton_unsupported

from .test_triton import DEVICE, _close, _expand_heads, _outputs_and_grads

F64 = dict(dtype=torch.float64, device=DEVICE)


def _dense_documents(ids, lq):
    """(B|1, 1, Lq, Lk) bool: query i (at key position i + Lk - Lq) and key j share a document;
    a query before the first key shares none. Written from the definition, as a dense mask."""
    lk = ids.shape[-1]
    positions = torch.arange(lq, device=ids.device) + lk - lq
    query_ids = ids[:, positions.clamp(min=0)]  # (B|1, Lq)
    same = (query_ids[:, :, None] == ids[:, None, :]) & (positions >= 0)[None, :, None]
    return same[:, None]


def _dense_decay(log_forget, lq):
    """(B|1, H|1, Lq, Lk): -|c_pos(i) - c_j|, c = cumsum(log_forget); c = 0 before the first key.
    Differentiable, so the reference's gradient reaches log_forget."""
    c = log_forget.cumsum(-1)
    lk = c.shape[-1]
    c_query = torch.cat(
        [c.new_zeros(*c.shape[:-1], max(lq - lk, 0)), c[..., max(lk - lq, 0) :]], -1
    )
    return -(c_query[..., :, None] - c[..., None, :]).abs()


def _reference(q, k, v, *, document_ids=None, bias=None, attn_mask=None, **call):
    """The reference on the dense forms: documents as a bool mask (and-ed with attn_mask), a
    Decay as its dense bias; GQA by repeating key/value heads."""
    lq, h = q.shape[2], q.shape[1]
    if document_ids is not None:
        same = _dense_documents(document_ids, lq)
        if attn_mask is None or attn_mask.dtype == torch.bool:
            attn_mask = same if attn_mask is None else attn_mask & same
        else:  # a float mask: -inf outside the document
            attn_mask = torch.where(same, attn_mask, float("-inf"))
    if isinstance(bias, Decay):
        bias = _dense_decay(bias.log_forget, lq)
    k, v = _expand_heads(k, h), _expand_heads(v, h)
    return reference_attention(q, k, v, bias=bias, attn_mask=attn_mask, **call)


def _ids(kind, b, lk, gen):
    """Document ids (B, Lk): "packed" sorted documents of 1 to 20 keys (some of length 1),
    "unsorted" random ids from 3 values (documents interleaved), "shared" one row (1, Lk)."""
    if kind == "unsorted":
        return torch.randint(0, 3, (b, lk), generator=gen).to(DEVICE)
    rows = []
    for _ in range(1 if kind == "shared" else b):
        lengths = [1, 1, *torch.randint(1, 21, (lk,), generator=gen).tolist()]
        rows.append(torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[:lk])
    return (torch.stack(rows) + 5).to(DEVICE)  # ids need not start at 0


def _qkv(b, h, hk, lq, lk, d, dv, gen):
    return [
        torch.randn(*shape, generator=gen).to(**F64).requires_grad_()
        for shape in ((b, h, lq, d), (b, hk, lk, d), (b, hk, lk, dv))
    ]


def _gate(kind, b, h, lq, lk, gen):
    if kind is None:
        return None, []
    if kind == "toeplitz":
        table = torch.randn(h, 9, generator=gen).to(**F64).mul(0.5).add(1).requires_grad_()
        return Toeplitz(table), [table]
    if kind == "relation":
        table = torch.randn(h, 5, generator=gen).to(**F64).mul(0.5).add(1).requires_grad_()
        return Relation(table, torch.randint(0, 5, (b, lq, lk), generator=gen).to(DEVICE)), [table]
    dense = torch.randn(b, h, lq, lk, generator=gen).to(**F64).mul(0.5).add(1).requires_grad_()
    return dense, [dense]


def _check(qkv, params, call):
    out, grads = _outputs_and_grads(triton_attention, qkv, params, call)
    expected, expected_grads = _outputs_and_grads(_reference, qkv, params, call)
    _close(out, expected)
    for got, want in zip(grads, expected_grads, strict=True):
        _close(got, want)
    return out


# (B, H, Hkv, Lq, Lk): odd lengths, Lq < Lk, Lq > Lk (queries before the first key), GQA
SHAPES = ((2, 2, 1, 21, 37), (1, 2, 2, 40, 29), (2, 4, 2, 33, 33))
DOCUMENT_GRID = [
    # ids, normalisation, causal, padding, bool attn_mask, gate, shape
    ("packed", "softmax", True, False, False, "toeplitz", SHAPES[0]),
    ("unsorted", "softmax", False, True, True, "relation", SHAPES[1]),
    ("packed", "l2", False, True, False, "dense", SHAPES[2]),
    ("shared", "exp", True, True, False, None, SHAPES[1]),
    ("unsorted", "relu2", True, False, True, "toeplitz", SHAPES[0]),
    ("packed", "relu2", False, False, False, "relation", SHAPES[1]),
]


@pytest.mark.parametrize(
    ("ids", "norm", "causal", "padding", "mask", "gate", "shape"),
    DOCUMENT_GRID,
    ids=["-".join(map(str, g[:6])) for g in DOCUMENT_GRID],
)
def test_documents_match_the_dense_mask(ids, norm, causal, padding, mask, gate, shape):
    b, h, hk, lq, lk = shape
    gen = torch.Generator().manual_seed(lq + lk)
    qkv = _qkv(b, h, hk, lq, lk, 16, 24, gen)
    gate, gate_params = _gate(gate, b, h, lq, lk, gen)
    call = dict(document_ids=_ids(ids, b, lk, gen), gate=gate, is_causal=causal, normalization=norm)
    if padding:
        call["key_padding_mask"] = (torch.rand(b, lk, generator=gen) < 0.2).to(DEVICE)
    if mask:
        call["attn_mask"] = (torch.rand(b, 1, lq, lk, generator=gen) < 0.8).to(DEVICE)
    _check(qkv, [*qkv, *gate_params], call)


DECAY_GRID = [
    # log_forget shape (B|1, H|1, Lk), normalisation, causal, documents, gate, shape
    ("full", "softmax", True, False, "toeplitz", SHAPES[0]),
    ("shared batch", "softmax", False, True, "relation", SHAPES[1]),
    ("shared head", "l2", True, True, None, SHAPES[2]),
    ("full", "exp", False, False, "dense", SHAPES[1]),
    ("full", "relu2", True, False, "relation", SHAPES[2]),
]


@pytest.mark.parametrize(
    ("form", "norm", "causal", "documents", "gate", "shape"),
    DECAY_GRID,
    ids=["-".join(map(str, g[:5])) for g in DECAY_GRID],
)
def test_decay_matches_its_dense_bias_with_gradients_to_log_forget(
    form, norm, causal, documents, gate, shape
):
    b, h, hk, lq, lk = shape
    gen = torch.Generator().manual_seed(lq * lk)
    qkv = _qkv(b, h, hk, lq, lk, 16, 16, gen)
    lf_shape = {"full": (b, h, lk), "shared batch": (h, lk), "shared head": (b, 1, lk)}[form]
    # log sigmoid of N(2, 1): forget gates near 1, as FoX's are; exact zeros (sign(0) = 0) too
    log_forget = torch.nn.functional.logsigmoid(torch.randn(lf_shape, generator=gen) + 2)
    log_forget[..., 3] = 0.0
    log_forget = log_forget.to(**F64).requires_grad_()
    gate, gate_params = _gate(gate, b, h, lq, lk, gen)
    call = dict(bias=Decay(log_forget), gate=gate, is_causal=causal, normalization=norm)
    if documents:
        call["document_ids"] = _ids("unsorted", b, lk, gen)
        call["key_padding_mask"] = (torch.rand(b, lk, generator=gen) < 0.2).to(DEVICE)
    _check(qkv, [*qkv, log_forget, *gate_params], call)


def test_documents_and_decay_with_dropout_and_a_float_mask():
    """Dropout's regenerated mask after the gate, and a float attn_mask (added to the Decay,
    which is then dense)."""
    b, h, lq, lk, p, seed = 2, 2, 19, 35, 0.3, 5
    gen = torch.Generator().manual_seed(3)
    qkv = _qkv(b, h, h, lq, lk, 16, 16, gen)
    log_forget = (-torch.rand(b, h, lk, generator=gen)).to(**F64).requires_grad_()
    ids = _ids("packed", b, lk, gen)
    call = dict(bias=Decay(log_forget), document_ids=ids, is_causal=True)
    keep = dropout_keep_mask(b, h, lq, lk, p, seed, DEVICE)

    def with_dropout(q, k, v, bias, document_ids, **c):
        weights = reference_weights(
            q,
            k,
            bias=_dense_decay(bias.log_forget, lq),
            attn_mask=_dense_documents(document_ids, lq),
            **c,
        )
        return (weights * keep / (1 - p)) @ v

    fn = lambda *a, **c: triton_attention(*a, **c, dropout_p=p, dropout_seed=seed)  # noqa: E731
    params = [*qkv, log_forget]
    out, grads = _outputs_and_grads(fn, qkv, params, call)
    expected, expected_grads = _outputs_and_grads(with_dropout, qkv, params, call)
    _close(out, expected)
    for got, want in zip(grads, expected_grads, strict=True):
        _close(got, want)
    float_mask = torch.randn(lq, lk, generator=gen).to(**F64)
    call["attn_mask"] = float_mask
    _check(qkv, params, call)


@pytest.mark.filterwarnings("ignore:All-NaN slice")  # the interpreter's max over NaN logits
def test_key_tiles_of_other_documents_are_never_read():
    """Two documents of 32 keys (two 16-key tiles each): NaN in the second's keys and values
    never reaches the first's outputs or gradients, as it would if the kernel read those tiles
    (0 x NaN is NaN in the weighted sum); and the upstream gradient's NaN rows of the second
    document's queries never reach the first's key gradients."""
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 1, 64, 16, generator=gen).to(**F64) for _ in "qkv")
    k[:, :, 32:] = float("nan")
    v[:, :, 32:] = float("nan")
    ids = torch.arange(64, device=DEVICE)[None] // 32
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = triton_attention(*leaves, document_ids=ids)
    assert torch.isfinite(out[:, :, :32]).all()
    upstream = torch.ones_like(out)
    upstream[:, :, 32:] = float("nan")
    grads = torch.autograd.grad(out, leaves, upstream)
    assert all(torch.isfinite(g[:, :, :32]).all() for g in grads)
    clean = [t[:, :, :32] for t in (q, k, v)]
    _close(out[:, :, :32], torch.nn.functional.scaled_dot_product_attention(*clean))


def test_decay_gradients_are_deterministic_without_atomics():
    """Under torch's deterministic mode a Decay needs no dense fallback: its d c is written once
    per entry by the two backward kernels; two runs agree bitwise."""
    gen = torch.Generator().manual_seed(8)
    qkv = _qkv(1, 2, 2, 24, 24, 16, 16, gen)
    log_forget = (-torch.rand(1, 2, 24, generator=gen)).to(**F64).requires_grad_()
    call = dict(bias=Decay(log_forget), gate=Toeplitz(torch.ones(2, 5, **F64)), is_causal=True)
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        runs = [
            _outputs_and_grads(triton_attention, qkv, [*qkv, log_forget], call)[1] for _ in range(2)
        ]
    finally:
        torch.use_deterministic_algorithms(previous)
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


def test_auto_and_the_capability_check_take_documents_and_decay():
    """The Triton backend accepts both (no refusal left in its capability check), and
    urpe.attention(backend="triton") gives the reference's result (int16 ids here)."""
    gen = torch.Generator().manual_seed(6)
    qkv = _qkv(2, 2, 2, 17, 17, 16, 16, gen)
    call = dict(
        document_ids=_ids("packed", 2, 17, gen).to(torch.int16),
        bias=Decay((-torch.rand(2, 2, 17, generator=gen)).to(**F64)),
    )
    assert triton_unsupported(*qkv, **call) is None
    out = attention(*qkv, **call, backend="triton")
    _close(out, _reference(*qkv, **call))


@pytest.mark.filterwarnings("ignore:There is a performance drop")  # masks.py's scatter_ in vmap
def test_vmap_of_grad_folds_documents_and_decay_into_the_batch():
    """Per-example gradients (vmap of grad) with per-example document ids and log_forget: the
    raw ops' vmap rule folds both into the batch (one launch) and matches a loop."""
    gen = torch.Generator().manual_seed(12)
    n, b, h, l, d = 2, 1, 2, 18, 16
    q = torch.randn(n, b, h, l, d, generator=gen).to(**F64)
    k, v = (torch.randn(b, h, l, d, generator=gen).to(**F64) for _ in "kv")
    ids = torch.stack([_ids("packed", b, l, gen), _ids("unsorted", b, l, gen)])  # (N, B, L)
    log_forget = (-torch.rand(n, b, h, l, generator=gen)).to(**F64)

    def loss(q, ids, log_forget):
        out = attention(
            q, k, v, document_ids=ids, bias=Decay(log_forget), is_causal=True, backend="triton"
        )
        return out.square().sum()

    got = torch.func.vmap(torch.func.grad(loss, argnums=(0, 2)))(q, ids, log_forget)
    for i in range(n):
        leaves = [q[i].clone().requires_grad_(), log_forget[i].clone().requires_grad_()]
        want = torch.autograd.grad(loss(leaves[0], ids[i], leaves[1]), leaves)
        for g, w in zip(got, want, strict=True):
            _close(g[i], w)


def test_auto_leaves_plain_softmax_to_sdpa_but_not_packed_documents():
    """On a GPU (meta tensors stand in), plain softmax goes to SDPA's FlashAttention; with
    document ids SDPA would need the dense (Lq, Lk) mask, so the Triton kernel keeps the call."""
    from urpe.kernels.spec import resolve
    from urpe.kernels.triton import spec_defers

    q = torch.empty(2, 2, 64, 16, device="meta")
    ids = torch.empty(2, 64, device="meta", dtype=torch.int64)
    assert "SDPA" in spec_defers(resolve(q, q, q))
    assert spec_defers(resolve(q, q, q, document_ids=ids)) is None
