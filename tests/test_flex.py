"""The FlexAttention route against the reference in float64: what is particular to it (the
shared grid of cases is in test_backend_conformance.py): zero gate entries, masks, refusals.

The route is exact (an identity, not an approximation), so in float64 it must agree with the
reference to rounding, about 1e-15 relative. PyTorch refuses FlexAttention's backward on the CPU
in its argument check only; its eager implementation differentiates fine there. The tests lift
that check (monkeypatch) so that FlexAttention's own backward supplies the gradients, as it does
on a GPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.attention.flex_attention as flex_module

from urpe.kernels import Relation, Toeplitz, attention, reference_attention
from urpe.kernels.flex import flex_unsupported, flex_urpe_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


@pytest.fixture
def flex(monkeypatch):
    """FlexAttention with its CPU-backward refusal lifted (a no-op on CUDA)."""
    monkeypatch.setattr(flex_module, "_validate_device", lambda *args: None)
    return flex_module.flex_attention


def _inputs(b, h, hk, lq, lk, d, gen):
    f = dict(dtype=torch.float64, device=DEVICE)
    q = torch.randn(b, h, lq, d, generator=gen).to(**f).requires_grad_()
    k = torch.randn(b, hk, lk, d, generator=gen).to(**f).requires_grad_()
    v = torch.randn(b, hk, lk, d + 3, generator=gen).to(**f).requires_grad_()
    return q, k, v


def _gate(kind, h, lq, lk, b, gen):
    f = dict(dtype=torch.float64, device=DEVICE)
    if kind == "positive":  # the paper's regime: C near 1
        table = (1 + 0.3 * torch.randn(h, 13, generator=gen)).to(**f)
        return Toeplitz(table.requires_grad_()), table
    if kind == "signed":  # negative entries and exact zeros
        table = torch.randn(h, 13, generator=gen).to(**f)
        table[:, ::4] = 0.0
        return Toeplitz(table.requires_grad_()), table
    if kind == "relation":
        table = torch.randn(1, 5, generator=gen).to(**f).requires_grad_()
        index = torch.randint(0, 5, (b, lq, lk), generator=gen).to(DEVICE)
        return Relation(table, index), table
    dense = torch.randn(b, h, lq, lk, generator=gen).to(**f).requires_grad_()  # "dense"
    return dense, dense


def test_zero_gate_entries_keep_their_gradient(flex):
    """d out / d c_ij = a_ij (dO_i . v_j) also where c_ij = 0: the shifted form keeps it."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = _inputs(1, 1, 1, 9, 9, 16, gen)
    table = torch.zeros(1, 17, dtype=torch.float64, device=DEVICE, requires_grad=True)
    out = flex_urpe_attention(q, k, v, gate=Toeplitz(table), flex=flex)
    assert torch.all(out == 0)
    (grad,) = torch.autograd.grad(out.sum(), table)
    (want,) = torch.autograd.grad(reference_attention(q, k, v, gate=Toeplitz(table)).sum(), table)
    assert want.abs().max() > 0.1
    torch.testing.assert_close(grad, want, rtol=1e-12, atol=1e-12)


def test_forward_without_gradients_runs_through_the_backend():
    """Through `urpe.attention`: eager FlexAttention on the CPU (float64), compiled on CUDA
    (float32, which compiled FlexAttention supports)."""
    gen = torch.Generator().manual_seed(5)
    dtype, tol = (torch.float32, 1e-4) if DEVICE == "cuda" else (torch.float64, 1e-12)
    q, k, v = (t.detach().to(dtype) for t in _inputs(1, 2, 2, 12, 12, 16, gen))
    gate = Toeplitz(1 + 0.2 * torch.randn(2, 7, generator=gen).to(DEVICE, dtype))
    with torch.no_grad():
        out = attention(q, k, v, gate=gate, is_causal=True, backend="flex")
    expected = reference_attention(q, k, v, gate=gate, is_causal=True)
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol)


def test_flex_says_why_it_cannot():
    q = torch.randn(1, 2, 8, 16, device=DEVICE)
    assert "relu2" in flex_unsupported(q=q, k=q, v=q, normalization="relu2")
    assert "dropout" in flex_unsupported(q=q, k=q, v=q, dropout_p=0.1)
    assert "multiple" in flex_unsupported(q=q, k=q[:, :1].expand(1, 3, 8, 16), v=q)
    if DEVICE == "cpu":
        grad = q.clone().requires_grad_()
        assert "backward" in flex_unsupported(q=grad, k=q, v=q)
        mask = torch.zeros(8, 8, requires_grad=True)  # a float mask that wants its gradient
        assert "backward" in flex_unsupported(q=q, k=q, v=q, attn_mask=mask)
        with pytest.raises(ValueError, match="backend 'flex' cannot run this call"):
            attention(grad, q, q, backend="flex")


# ---------------------------------------------------------------------------------------------
# attn_mask: bool joins the BlockMask, float is added in score_mod


def _attn_mask(kind: str, b: int, h: int, lq: int, lk: int, gen) -> torch.Tensor:
    """bool (Lq, Lk), bool (B, H, Lq, Lk), float (B, 1, Lq, Lk) or float (1, H, 1, Lk). Query 2 of
    the first batch entry and head sees nothing: hidden (bool) or only -inf logits (float)."""
    shape = {
        "bool": (lq, lk),
        "bool per head": (b, h, lq, lk),
        "float": (b, 1, lq, lk),
        "float per head": (1, h, 1, lk),
    }[kind]
    row = (0,) * (len(shape) - 2) + (min(2, shape[-2] - 1),)
    if kind.startswith("bool"):
        mask = torch.rand(shape, generator=gen) < 0.7
        mask[row] = False
        return mask.to(DEVICE)
    mask = torch.randn(shape, generator=gen, dtype=torch.float64)
    mask[row] = float("-inf")
    return mask.to(DEVICE)


MASK_CASES = [
    # (normalization, mask kind, (B, H, Hkv, Lq, Lk, D))
    ("softmax", "bool", (2, 2, 2, 13, 17, 16)),
    ("l2", "bool per head", (2, 4, 2, 15, 15, 16)),
    ("exp", "float", (2, 2, 1, 11, 19, 16)),
    ("softmax", "float per head", (1, 2, 2, 16, 12, 16)),
]


@pytest.mark.parametrize(("norm", "kind", "shape"), MASK_CASES)
def test_attn_mask_through_the_backend_matches_the_reference(norm, kind, shape):
    """Forward through `urpe.attention(..., backend="flex")` (eager FlexAttention on the CPU), with
    causal masking, key padding, a Toeplitz bias and a signed gate beside the mask."""
    b, h, hk, lq, lk, d = shape
    gen = torch.Generator().manual_seed(MASK_CASES.index((norm, kind, shape)))
    q, k, v = (t.detach() for t in _inputs(b, h, hk, lq, lk, d, gen))
    gate, _ = _gate("signed", h, lq, lk, b, gen)
    padding = (torch.rand(b, lk, generator=gen) < 0.2).to(DEVICE)
    call = dict(
        bias=Toeplitz(0.5 * torch.randn(h, 9, generator=gen).to(q)),
        gate=Toeplitz(gate.table),
        attn_mask=_attn_mask(kind, b, h, lq, lk, gen),
        key_padding_mask=padding,
        is_causal=True,
        normalization=norm,
        enable_gqa=hk != h,
    )
    with torch.no_grad():
        out = attention(q, k, v, **call, backend="flex")
        expected = attention(q, k, v, **call, backend="reference")
    error = (out - expected).norm() / expected.norm()
    assert error < 1e-13, f"relative error {error:.2e}"
    assert torch.equal(out[0, 0, 2], torch.zeros_like(out[0, 0, 2]))


@pytest.mark.parametrize("kind", ["bool per head", "float"])
def test_attn_mask_gradients_come_from_flexattention_backward(flex, kind):
    """Gradients of q, k, v, the tables and a float mask, from FlexAttention's own backward."""
    b, h, lq, lk = 2, 2, 14, 18
    gen = torch.Generator().manual_seed(11)
    q, k, v = _inputs(b, h, h, lq, lk, 16, gen)
    bias_table = (0.5 * torch.randn(h, 11, generator=gen)).to(q).requires_grad_()
    gate, gate_table = _gate("positive", h, lq, lk, b, gen)
    mask = _attn_mask(kind, b, h, lq, lk, gen)
    params = [q, k, v, bias_table, gate_table]
    if kind == "float":
        mask.requires_grad_()
        params.append(mask)
    call = dict(bias=Toeplitz(bias_table), gate=gate, attn_mask=mask, normalization="softmax")
    out = flex_urpe_attention(q, k, v, **call, flex=flex)
    expected = reference_attention(q, k, v, **call)
    weight = torch.randn(out.shape, generator=gen, dtype=out.dtype).to(DEVICE)
    grads = torch.autograd.grad((out * weight).sum(), params)
    expected_grads = torch.autograd.grad((expected * weight).sum(), params)
    for got, want in zip((out, *grads), (expected, *expected_grads), strict=True):
        error = (got - want).norm() / want.norm().clamp_min(1e-300)
        assert error < 1e-13, f"relative error {error:.2e}"
    assert torch.all(grads[0][0, 0, 2] == 0)  # the query that sees nothing gets no gradient
