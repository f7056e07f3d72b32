"""The Triton kernel against the reference (the specification): what is particular to it (the
shared grid of cases is in test_backend_conformance.py): tiles, head dims, masks, dropout,
precision, autotuning keys, transforms.

On a machine without CUDA the kernels run under Triton's interpreter (conftest sets
TRITON_INTERPRET=1 before anything imports triton); with CUDA they run natively, same tests.
Triton is a hard requirement here: without it this module fails to import, it never skips.

Tiles of 16 x 16 (the interpreter's default) make every shape below span several query and key
blocks, so the online rescaling, causal tile skipping, per-tile table-gradient reduction and
their atomic combination are all exercised.
"""

from __future__ import annotations

import math

import pytest
import torch
import triton
from torch import Tensor

from urpe.kernels import (
    Relation,
    Toeplitz,
    attention,
    reference_attention,
    reference_weights,
)
from urpe.kernels.triton import (
    dropout_keep_mask,
    triton_attention,
    triton_defers,
    triton_unsupported,
)

from . import test_transforms as transforms

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NORMALIZATIONS_LIST = ("softmax", "exp", "l2", "relu2")
MASKS = ("none", "causal", "padding", "causal+padding")
TERM_KINDS = (
    (None, None),
    ("toeplitz", "toeplitz"),
    ("relation", "dense_broadcast"),
    ("dense", "relation_shared"),
    ("toeplitz_shared", "dense"),
)
# (B, H, Hkv, Lq, Lk, D, Dv): odd lengths, Lq < Lk and Lq > Lk, GQA, several tiles each way
SHAPES = (
    (2, 2, 2, 21, 37, 16, 19),
    (1, 4, 2, 33, 33, 32, 32),
    (2, 2, 1, 40, 18, 24, 16),
)


def test_the_interpreter_runs_where_there_is_no_gpu():
    assert torch.cuda.is_available() or triton.knobs.runtime.interpret


def _term(kind, b, h, lq, lk, gen, dtype):
    """A bias or gate of the given kind, and the tensors whose gradients are compared."""
    f = dict(dtype=dtype, device=DEVICE)
    if kind is None:
        return None, []
    if kind == "toeplitz":  # K = 5 < L: far offsets are clipped to the edge entries
        table = torch.randn(h, 11, generator=gen).to(**f).mul(0.5).add(1).requires_grad_()
        return Toeplitz(table), [table]
    if kind == "toeplitz_shared":  # one row for every head, K larger than L
        table = torch.randn(1, 2 * 45 + 1, generator=gen).to(**f).mul(0.5).requires_grad_()
        return Toeplitz(table), [table]
    if kind in ("relation", "relation_shared"):
        heads, rb = (h, b) if kind == "relation" else (1, 1)
        table = torch.randn(heads, 7, generator=gen).to(**f).mul(0.5).add(0.5).requires_grad_()
        index = torch.randint(0, 7, (rb, lq, lk), generator=gen).to(DEVICE)
        return Relation(table, index), [table]
    if kind == "dense":
        dense = torch.randn(b, h, lq, lk, generator=gen).to(**f).mul(0.5).requires_grad_()
        return dense, [dense]
    if kind == "dense_broadcast":  # (H, Lq, 1): broadcast over batch and keys
        dense = torch.randn(h, lq, 1, generator=gen).to(**f).mul(0.5).add(1).requires_grad_()
        return dense, [dense]
    raise ValueError(kind)


def _case(shape, mask, bias_kind, gate_kind, seed=0, dtype=torch.float64):
    b, h, hk, lq, lk, d, dv = shape
    gen = torch.Generator().manual_seed(seed)
    f = dict(dtype=dtype, device=DEVICE)
    q = torch.randn(b, h, lq, d, generator=gen).to(**f).requires_grad_()
    k = torch.randn(b, hk, lk, d, generator=gen).to(**f).requires_grad_()
    v = torch.randn(b, hk, lk, dv, generator=gen).to(**f).requires_grad_()
    bias, bias_tensors = _term(bias_kind, b, h, lq, lk, gen, dtype)
    gate, gate_tensors = _term(gate_kind, b, h, lq, lk, gen, dtype)
    padding = None
    if "padding" in mask:
        padding = (torch.rand(b, lk, generator=gen) < 0.3).to(DEVICE)
        padding[0] = True  # a batch row whose every key is padded: its output is 0
    call = dict(bias=bias, gate=gate, key_padding_mask=padding, is_causal="causal" in mask)
    return (q, k, v), [q, k, v, *bias_tensors, *gate_tensors], call


def _expand_heads(x, heads):
    """GQA for the reference: repeat each key/value head over its group of query heads."""
    return x.repeat_interleave(heads // x.shape[1], dim=1)


def _reference(q, k, v, **call):
    h = q.shape[1]
    return reference_attention(q, _expand_heads(k, h), _expand_heads(v, h), **call)


def _outputs_and_grads(fn, qkv, params, call):
    out = fn(*qkv, **call)
    weight = torch.linspace(-1, 1, out.numel(), dtype=out.dtype, device=out.device)
    grads = torch.autograd.grad((out * weight.view_as(out)).sum(), params)
    return out, grads


def _close(got, expected, rtol=1e-9, atol=1e-9):
    torch.testing.assert_close(got, expected, rtol=rtol, atol=atol)


@pytest.mark.parametrize(("block_q", "block_k"), [(16, 32), (32, 16)])
def test_unequal_tiles(block_q, block_k):
    """Tiles that are not square: the Toeplitz tile's diagonal count is bm + bn - 1."""
    qkv, params, call = _case((1, 2, 2, 45, 50, 16, 16), "causal", "toeplitz", "toeplitz")
    out, grads = _outputs_and_grads(
        lambda *a, **c: triton_attention(*a, **c, block_q=block_q, block_k=block_k),
        qkv,
        params,
        call,
    )
    expected, expected_grads = _outputs_and_grads(_reference, qkv, params, call)
    _close(out, expected)
    for got, want in zip(grads, expected_grads, strict=True):
        _close(got, want)


@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_head_dims(head_dim):
    qkv, params, call = _case((1, 1, 1, 20, 20, head_dim, head_dim), "none", "toeplitz", "dense")
    out, grads = _outputs_and_grads(triton_attention, qkv, params, call)
    expected, expected_grads = _outputs_and_grads(_reference, qkv, params, call)
    _close(out, expected)
    for got, want in zip(grads, expected_grads, strict=True):
        _close(got, want)


def test_causal_queries_with_no_visible_key_output_zero():
    """Lq > Lk under urpe's causal rule: the first Lq - Lk queries see no key at all."""
    qkv, params, call = _case((1, 2, 2, 30, 9, 16, 16), "causal", "toeplitz", "toeplitz")
    out, grads = _outputs_and_grads(triton_attention, qkv, params, call)
    assert torch.all(out[:, :, :21] == 0)
    expected, expected_grads = _outputs_and_grads(_reference, qkv, params, call)
    _close(out, expected)
    for got, want in zip(grads, expected_grads, strict=True):
        _close(got, want)


def test_infinite_bias_and_gate_entries_are_handled_like_the_reference():
    """A dense bias may hold -inf (a float mask), and a gate may hold inf or nan where keys are
    masked; hidden keys still get weight exactly 0."""
    qkv, params, call = _case((1, 2, 2, 20, 20, 16, 16), "causal", "dense", None)
    bias = call["bias"].detach().clone()
    bias[..., 3] = float("-inf")  # key 3 hidden from everyone through the bias
    gate = torch.ones(1, 2, 20, 20, dtype=torch.float64, device=DEVICE)
    gate.masked_fill_(torch.ones(20, 20, dtype=torch.bool, device=DEVICE).triu(1), float("nan"))
    call.update(bias=bias, gate=gate)
    out, grads = _outputs_and_grads(triton_attention, qkv, params[:3], call)
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
    _close(out, _reference(*qkv, **call))
    # The reference's backward multiplies a zero gradient by the nan; the same function with
    # the hidden gate entries set to 1 is finite and is what the gradients must match.
    clean = dict(call, gate=gate.nan_to_num(1.0))
    expected, expected_grads = _outputs_and_grads(_reference, qkv, params[:3], clean)
    _close(out, expected)
    for got, want in zip(grads, expected_grads, strict=True):
        _close(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_lower_precision_accumulates_in_float32(dtype):
    """Against the float64 reference on the same (rounded) inputs: relative error of a
    float32 accumulation with half-precision matrix operands."""
    qkv, params, call = _case(
        (2, 2, 2, 40, 40, 64, 64), "causal+padding", "toeplitz", "toeplitz", dtype=dtype
    )
    out, grads = _outputs_and_grads(triton_attention, qkv, params, call)
    assert out.dtype == dtype and all(g.dtype == dtype for g in grads)
    wide = [p.detach().double().requires_grad_() for p in params]
    wide_call = dict(call, bias=Toeplitz(wide[3]), gate=Toeplitz(wide[4]))
    expected, expected_grads = _outputs_and_grads(_reference, wide[:3], wide, wide_call)
    limit = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 1e-5}[dtype]
    for got, want in zip((out, *grads), (expected, *expected_grads), strict=True):
        error = (got.double() - want).norm() / want.norm()
        assert error < limit, f"relative error {error:.2e}"


@pytest.mark.slow
def test_dropout_applies_the_regenerated_mask_after_the_gate():
    p, seed = 0.3, 1234
    qkv, params, call = _case((2, 2, 2, 21, 37, 16, 16), "causal+padding", "toeplitz", "toeplitz")
    fn = lambda *a, **c: triton_attention(*a, **c, dropout_p=p, dropout_seed=seed)  # noqa: E731
    out, grads = _outputs_and_grads(fn, qkv, params, call)
    keep = dropout_keep_mask(2, 2, 21, 37, p, seed, DEVICE)

    def with_mask(q, k, v, **c):
        weights = reference_weights(q, k, **c) * keep / (1 - p)  # the gate is applied inside
        return weights @ v

    expected, expected_grads = _outputs_and_grads(with_mask, qkv, params, call)
    _close(out, expected)
    for got, want in zip(grads, expected_grads, strict=True):
        _close(got, want)
    again = triton_attention(*qkv, **call, dropout_p=p, dropout_seed=seed)
    other = triton_attention(*qkv, **call, dropout_p=p, dropout_seed=seed + 1)
    assert torch.equal(again, out) and not torch.allclose(other[1], out[1])


def test_dropout_keeps_the_expected_fraction():
    keep = dropout_keep_mask(2, 3, 64, 80, 0.25, 7, DEVICE)
    fraction = keep.double().mean().item()
    # 30720 Bernoulli(0.75) draws: standard deviation 0.0025
    assert abs(fraction - 0.75) < 0.01
    assert not torch.equal(keep[0, 0], keep[0, 1])  # heads draw different masks


def test_the_kernel_is_a_registered_backend_that_auto_leaves_alone_on_the_cpu():
    qkv, _, call = _case((1, 2, 2, 17, 17, 16, 16), "causal", "toeplitz", "toeplitz")
    out = attention(*qkv, **call, backend="triton")
    _close(out, _reference(*qkv, **call))
    full = dict(q=qkv[0], k=qkv[1], v=qkv[2], normalization="softmax", dropout_p=0.0, **call)
    assert triton_unsupported(**full) is None
    if DEVICE == "cpu":
        assert "interpreter" in triton_defers(**full)
    else:
        assert triton_defers(**full) is None


def test_unsupported_calls_say_why():
    meta = torch.empty(1, 2, 8, 16, device="meta")
    assert "CUDA" in triton_unsupported(q=meta, k=meta, v=meta)
    q = torch.randn(1, 3, 8, 16, device=DEVICE)
    k = torch.randn(1, 2, 8, 16, device=DEVICE)
    assert "multiple" in triton_unsupported(q=q, k=k, v=k)
    wide = torch.randn(1, 1, 8, 512, device=DEVICE)
    assert "head dims" in triton_unsupported(q=wide, k=wide, v=wide)
    with pytest.raises(ValueError, match=r"bias index must lie in \[0, 3\)"):
        table = torch.randn(1, 3, device=DEVICE)
        index = torch.full((1, 8, 8), 3, device=DEVICE)
        triton_attention(q[:, :2], k, k, bias=Relation(table, index))


def test_raw_ops_pass_torch_library_checks():
    """Schema and fake (meta) implementations of both raw ops (the autograd lives in the
    autograd.Function around them), with a Toeplitz bias, a dense gate and a boolean mask."""
    from urpe.kernels.triton import ops

    gen = torch.Generator().manual_seed(0)
    f = dict(dtype=torch.float64, device=DEVICE)
    q, k, v = (torch.randn(1, 2, 18, 16, generator=gen).to(**f) for _ in range(3))
    table = torch.randn(2, 9, generator=gen).to(**f)
    gate = torch.rand(1, 2, 18, 18, generator=gen).to(**f)
    mask = (torch.rand(1, 1, 18, 18, generator=gen) < 0.8).to(DEVICE)
    tensors = (q, k, v, table, None, gate, None, mask, None, None, None)
    scalars = ("toeplitz", "dense", True, "softmax", 0.25, 0.0, 0, 0)
    checks = ("test_schema", "test_faketensor")
    torch.library.opcheck(ops.TRITON.forward_op, (*tensors, *scalars), test_utils=checks)
    out, stat = ops.TRITON.forward_op(*tensors, *scalars)
    grad_out = torch.randn(out.shape, generator=gen).to(**f)
    args = (grad_out, out, stat, *tensors, *scalars, True, True, False)
    torch.library.opcheck(ops.TRITON.backward_op, args, test_utils=checks)


def test_scale_and_softmax_rows_sum_through_the_gate():
    """A constant gate c multiplies softmax attention by c exactly; a custom scale is honoured."""
    qkv, _, call = _case((1, 2, 2, 19, 23, 16, 16), "padding", None, None)
    call["key_padding_mask"][0] = False
    gate = Toeplitz(torch.full((1, 3), 2.5, dtype=torch.float64, device=DEVICE))
    scale = 0.7 / math.sqrt(16)
    gated = triton_attention(*qkv, **dict(call, gate=gate), scale=scale)
    plain = torch.nn.functional.scaled_dot_product_attention(
        *qkv, attn_mask=~call["key_padding_mask"][:, None, None, :], scale=scale
    )
    _close(gated, 2.5 * plain)


@pytest.mark.parametrize("name", ["forward", "backward_kv", "backward_q"])
def test_autotuning_keys_name_real_kernel_arguments(name):
    """The autotuner silently drops a key that is not an argument (then never re-tunes), and a
    misnamed reset_to_zero would leave atomically accumulated gradients dirty between trials."""
    from urpe.kernels.triton import launch

    tuner = launch.tuned(name)
    assert set(launch.TUNING_KEY) <= set(tuner.keys) <= set(tuner.arg_names)
    assert set(tuner.reset_to_zero) <= set(tuner.arg_names)
    if name == "backward_q":
        assert set(tuner.reset_to_zero) == {"dB_ptr", "dC_ptr"}
        for config in tuner.configs:  # the Toeplitz gradient needs every diagonal of a tile
            m, n = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"]
            assert config.kwargs["WIDTH"] >= m + n - 1


def test_strided_inputs_one_query_and_narrow_heads():
    """Inputs as non-contiguous views (a (B, L, H, D) layout transposed, a column-sliced padding
    mask), a single query (decoding against a cache) and a head dim below 16 (padded inside)."""
    gen = torch.Generator().manual_seed(11)
    f = dict(dtype=torch.float64, device=DEVICE)
    for lq, lk, d in ((1, 40, 8), (23, 23, 16)):
        leaves = [
            torch.randn(2, n, 3, d, generator=gen).to(**f).requires_grad_() for n in (lq, lk, lk)
        ]
        q, k, v = (t.transpose(1, 2) for t in leaves)  # (B, H, L, D) views
        assert not k.is_contiguous()
        padding = (torch.rand(2, 2 * lk, generator=gen) < 0.3).to(DEVICE)[:, ::2]
        table = torch.randn(3, 9, generator=gen).to(**f).requires_grad_()
        call = dict(gate=Toeplitz(table), key_padding_mask=padding, is_causal=True)
        params = [*leaves, table]
        out, grads = _outputs_and_grads(triton_attention, (q, k, v), params, call)
        expected, expected_grads = _outputs_and_grads(_reference, (q, k, v), params, call)
        _close(out, expected)
        for got, want in zip(grads, expected_grads, strict=True):
            _close(got, want)


# ---------------------------------------------------------------------------------------------
# attn_mask: bool hides pairs (read by the kernel), float is added to the bias

# mask forms and their shapes, broadcast forms included
MASK_FORMS = {
    "bool (Lq, Lk)": lambda b, h, lq, lk: (lq, lk),
    "bool (B, H, Lq, Lk)": lambda b, h, lq, lk: (b, h, lq, lk),
    "bool (1, H, 1, Lk)": lambda b, h, lq, lk: (1, h, 1, lk),
    "float (B, 1, Lq, Lk)": lambda b, h, lq, lk: (b, 1, lq, lk),
    "float (H, Lq, Lk)": lambda b, h, lq, lk: (h, lq, lk),
}


def _attn_mask(form: str, b: int, h: int, lq: int, lk: int, gen) -> Tensor:
    """A mask of the given form. Bool: about a quarter of the pairs hidden, and query 3 of the
    first batch entry and head sees nothing (with one query row: none of that head's queries
    do). Float: N(0, 1), and that row all -inf."""
    shape = MASK_FORMS[form](b, h, lq, lk)
    row = (0,) * (len(shape) - 2) + (min(3, shape[-2] - 1),)
    if form.startswith("bool"):
        mask = torch.rand(shape, generator=gen) < 0.75
        mask[row] = False
        return mask.to(DEVICE)
    mask = torch.randn(shape, generator=gen, dtype=torch.float64)
    mask[row] = float("-inf")
    return mask.to(DEVICE).requires_grad_()


# (B, H, Hkv, Lq, Lk, D, Dv): two tiles each way, GQA in one, Lq != Lk in both
MASK_SHAPES = ((2, 2, 1, 17, 20, 16, 16), (1, 2, 2, 18, 33, 16, 24))
# each mask form meets two normalisations (each normalisation two or three forms); terms and
# shapes rotate
MASK_GRID = [
    (
        form,
        NORMALIZATIONS_LIST[(i + j) % 4],
        TERM_KINDS[(i + j + 1) % len(TERM_KINDS)],
        MASK_SHAPES[(i + j // 2) % 2],
    )
    for i, form in enumerate(MASK_FORMS)
    for j in (0, 2)
]


@pytest.mark.parametrize(
    ("form", "norm", "terms", "shape"),
    MASK_GRID,
    ids=[f"{g[0].replace(' ', '')}-{g[1]}-{g[2][0]}-{g[2][1]}" for g in MASK_GRID],
)
def test_attn_mask_matches_the_reference_forward_and_gradients(form, norm, terms, shape):
    qkv, params, call = _case(shape, "causal", *terms, seed=len(form))
    b, h, _, lq, lk = shape[:5]
    mask = _attn_mask(form, b, h, lq, lk, torch.Generator().manual_seed(7))
    call.update(attn_mask=mask, normalization=norm, is_causal=False)
    if mask.requires_grad:
        params.append(mask)  # the float mask's own gradient
    out, grads = _outputs_and_grads(triton_attention, qkv, params, call)
    expected, expected_grads = _outputs_and_grads(_reference, qkv, params, call)
    _close(out, expected)
    for got, want in zip(grads, expected_grads, strict=True):
        _close(got, want)
    # query 3 of batch 0, head 0 sees nothing (bool) or only -inf logits (float): zeros
    assert torch.equal(out[0, 0, 3], torch.zeros_like(out[0, 0, 3]))
    assert torch.equal(grads[0][0, 0, 3], torch.zeros_like(grads[0][0, 0, 3]))


def test_bool_mask_hides_pairs_whatever_the_gate_and_values_hold():
    """Hidden pairs weigh exactly 0: a NaN gate entry or a NaN value row that the bool mask
    hides never reaches an output (through urpe.attention's non-finite rule for v)."""
    gen = torch.Generator().manual_seed(4)
    f = dict(dtype=torch.float64, device=DEVICE)
    q, k, v = (torch.randn(1, 2, 20, 16, generator=gen).to(**f) for _ in range(3))
    mask = torch.ones(20, 20, dtype=torch.bool, device=DEVICE)
    mask[:, 5] = False  # key 5 hidden from everyone
    mask[7] = False  # query 7 sees nothing
    gate = torch.ones(1, 2, 20, 20, **f)
    gate[..., 5] = float("nan")
    v[:, :, 5] = float("nan")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attention(*leaves, attn_mask=mask, gate=gate, normalization="l2", backend="triton")
    assert torch.isfinite(out).all() and torch.all(out[:, :, 7] == 0)
    grads = torch.autograd.grad(out.square().sum(), leaves)
    assert all(torch.isfinite(g).all() for g in grads)
    assert torch.all(grads[0][:, :, 7] == 0) and torch.all(grads[1][:, :, 5] == 0)
    clean_v = v.clone()
    clean_v[:, :, 5] = 0.0
    expected = reference_attention(
        q, k, clean_v, attn_mask=mask, gate=gate.nan_to_num(1.0), normalization="l2"
    )
    _close(out, expected)


def test_float_mask_with_a_relation_bias_in_half_precision():
    """A float mask on a Relation bias: the two are summed in float32 for float16 inputs."""
    qkv, params, call = _case(
        (2, 2, 2, 19, 23, 32, 32), "padding", "relation", "toeplitz", dtype=torch.float16
    )
    mask = (0.5 * torch.randn(2, 1, 19, 23)).to(DEVICE, torch.float16)
    out = triton_attention(*qkv, **call, attn_mask=mask)
    wide = [p.detach().double() for p in params]
    wide_call = dict(call, bias=Relation(wide[3], call["bias"].index), gate=Toeplitz(wide[4]))
    expected = _reference(*wide[:3], **wide_call, attn_mask=mask.double())
    error = (out.double() - expected).norm() / expected.norm()
    assert out.dtype == torch.float16 and error < 3e-3, f"relative error {error:.2e}"


# ---------------------------------------------------------------------------------------------
# torch.func and torch.compile: the registry-wide transform tests, run on this backend


@pytest.mark.parametrize(
    "check",
    [
        transforms.test_func_grad_equals_autograd,
        transforms.test_vmap_equals_a_loop,
        transforms.test_per_example_gradients_with_vmap_of_grad,
        transforms.test_functional_call,
        transforms.test_compile_fullgraph_matches_eager_with_dropout_and_checks,
    ],
    ids=lambda check: check.__name__.removeprefix("test_"),
)
@pytest.mark.slow
def test_transforms_compose_with_the_kernel(check):
    """tests/test_transforms.py's checks (grad, vmap, vmap of grad, functional_call, compile
    with fullgraph=True) for backend "triton", which that file leaves out (a CUDA backend)."""
    check("triton")


def test_vmap_folds_masks_and_dense_terms_into_the_batch():
    """vmap over q, a bool attn_mask and a float one, with a shared dense bias: the rule folds
    the vmapped dim into the batch (one launch). Per-example gradients of the shared dense bias
    go through the folded backward and are summed back to its broadcast shape."""
    gen = torch.Generator().manual_seed(9)
    f = dict(dtype=torch.float64, device=DEVICE)
    n, b, h, l, d = 2, 2, 2, 12, 16
    q = torch.randn(n, b, h, l, d, generator=gen).to(**f)
    k, v = (torch.randn(b, 1, l, d, generator=gen).to(**f) for _ in range(2))  # GQA: one kv head
    hide = (torch.rand(n, 1, 1, l, l, generator=gen) < 0.8).to(DEVICE)
    add = torch.randn(n, b, 1, l, l, generator=gen).to(**f)
    bias = (0.5 * torch.randn(1, h, l, l, generator=gen)).to(**f)
    gate = Toeplitz((1 + 0.3 * torch.randn(h, 9, generator=gen)).to(**f))

    def loss(q, hide, add, bias):
        out = attention(
            q,
            k,
            v,
            attn_mask=hide,
            bias=bias + add,
            gate=gate,
            enable_gqa=True,
            is_causal=True,
            normalization="softmax",
            backend="triton",
        )
        return out.square().sum(), out

    grad = torch.func.vmap(
        torch.func.grad(loss, argnums=(0, 3), has_aux=True), in_dims=(0, 0, 0, None)
    )
    (got_q, got_bias), got_out = grad(q, hide, add, bias)
    for i in range(n):
        leaves = [q[i].clone().requires_grad_(), bias.clone().requires_grad_()]
        value, out = loss(leaves[0], hide[i], add[i], leaves[1])
        want_q, want_bias = torch.autograd.grad(value, leaves)
        _close(got_out[i], out)
        _close(got_q[i], want_q)
        _close(got_bias[i], want_bias)


def test_the_old_argument_names_still_work_with_a_warning():
    qkv, _, call = _case((1, 2, 2, 17, 19, 16, 16), "causal", "toeplitz", "toeplitz")
    new = triton_attention(*qkv, **call, block_q=16, block_k=32, dropout_p=0.2, dropout_seed=3)
    with pytest.warns(DeprecationWarning, match="block_q"):
        old = triton_attention(*qkv, **call, block_m=16, block_n=32, dropout_p=0.2, seed=3)
    assert torch.equal(old, new)
    with pytest.raises(TypeError, match="unexpected keyword argument 'block_x'"):
        triton_attention(*qkv, **call, block_x=16)
