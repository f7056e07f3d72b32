"""The C++ kernel's output lies in (B, Lq, H, Dv) memory, returned as its (B, H, Lq, Dv) view.

A model's attention turns the output back into (B, Lq, H * Dv) rows for its out projection
(`out.transpose(1, 2).reshape(B, Lq, E)`): from that layout the reshape is a view, not a copy
of the whole output per layer. Every route that returns the kernel's output promises exactly
these strides in its fake implementation (torch.compile plans its graph by them), and the
backward pass reads the output in that layout.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from urpe.kernels import Toeplitz, reference_attention, resolve
from urpe.kernels.cpp import cpp_attention, unavailable
from urpe.kernels.cpp.arguments import IN_PLACE_LENGTH
from urpe.kernels.layout import ForwardArgs

pytestmark = pytest.mark.skipif(
    unavailable() is not None, reason=f"the C++ kernel is unavailable: {unavailable()}"
)
F64 = dict(dtype=torch.float64)
# (B, H, Hkv, Lq, Lk, D, Dv): grouped queries, Lq != Lk, one query, a long call, one head
SHAPES = [
    (2, 4, 2, 5, 7, 4, 3),
    (1, 3, 3, 1, 9, 8, 8),
    (2, 2, 1, IN_PLACE_LENGTH + 5, IN_PLACE_LENGTH + 5, 4, 4),
    (3, 1, 1, 6, 6, 4, 2),
]


def _strides_of_rows(b: int, h: int, lq: int, dv: int) -> tuple[int, ...]:
    """(B, H, Lq, Dv) strides of a view of (B, Lq, H, Dv) memory."""
    return torch.empty(b, lq, h, dv).transpose(1, 2).stride()


def _args(shape, seed=0) -> ForwardArgs:
    b, h, hkv, lq, lk, d, dv = shape
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, lq, d, generator=gen, **F64)
    k = torch.randn(b, hkv, lk, d, generator=gen, **F64)
    v = torch.randn(b, hkv, lk, dv, generator=gen, **F64)
    table = torch.randn(h, 2 * max(lq, lk) - 1, generator=gen, **F64)
    spec = resolve(q, k, v, bias=Toeplitz(table), enable_gqa=True, is_causal=lq > 1)
    return ForwardArgs.from_spec(spec)


def _fake_run(op, args) -> tuple[torch.Tensor, ...]:
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        result = op(*fake)
    return result if isinstance(result, tuple) else (result,)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_the_ops_output_lies_in_rows_of_heads_and_its_fake_says_so(shape):
    """The custom op, its eager route and the opaque compiled op give the output the strides
    of a (B, Lq, H, Dv) tensor's view, and their fake implementations promise the same."""
    from urpe.kernels.cpp.ops import CPP, GUARDED_FORWARD

    args = _args(shape)
    b, h, _, lq, _, _, dv = shape
    want = _strides_of_rows(b, h, lq, dv)
    for op in (CPP.forward_op, GUARDED_FORWARD):
        out = op(*args)
        out = out[0] if isinstance(out, tuple) else out
        assert out.shape == (b, h, lq, dv) and out.stride() == want
        assert _fake_run(op, args)[0].stride() == want
    # the plain eager route (no custom op) gives the same
    assert CPP(args).stride() == want


def test_the_opaque_op_lays_out_the_non_finite_rules_output_as_its_fake_says():
    """With a NaN key the opaque compiled op applies the non-finite rule (tensor ops, other
    strides): its output still has the strides its fake promises, and the rule's values."""
    from urpe.kernels import attention
    from urpe.kernels.cpp.ops import GUARDED_FORWARD

    args = _args(SHAPES[0])
    k = args.k.clone()
    k[0, 1, 2, 0] = float("nan")
    args = args._replace(k=k)
    out = GUARDED_FORWARD(*args)
    b, h, _, lq, _, _, dv = SHAPES[0]
    assert out.stride() == _strides_of_rows(b, h, lq, dv)
    want = attention(
        args.q,
        k,
        args.v,
        bias=Toeplitz(args.bias),
        enable_gqa=True,
        is_causal=True,
        backend="reference",
    )
    torch.testing.assert_close(out, want, equal_nan=True)


@pytest.mark.parametrize("length", [7, IN_PLACE_LENGTH + 5])
def test_the_backward_reads_the_output_where_it_lies(length):
    """Forward and backward in float64 against the reference, with the output in its rows of
    heads and dO as a (B, L, H * Dv) reshape gives it back."""
    b, h, d = 2, 3, 4
    gen = torch.Generator().manual_seed(3)
    leaves = [torch.randn(b, length, h * d, generator=gen, **F64) for _ in range(3)]
    table = torch.randn(h, 2 * length - 1, generator=gen, **F64)
    grad = torch.randn(b, length, h * d, generator=gen, **F64)

    def step(run):
        params = [t.clone().requires_grad_() for t in (*leaves, table)]
        q, k, v = (t.view(b, length, h, d).transpose(1, 2) for t in params[:3])
        out = run(q, k, v, bias=Toeplitz(params[3]), gate=Toeplitz(params[3].exp()))
        rows = out.transpose(1, 2).reshape(b, length, h * d)
        rows.backward(grad)
        return [rows.detach(), *(p.grad for p in params)]

    for got, want in zip(step(cpp_attention), step(reference_attention), strict=True):
        torch.testing.assert_close(got, want)


def test_the_models_attention_copies_no_output():
    """A model layer's attention on the C++ kernel in a training step: outside its linear
    projections the forward pass copies nothing (q, k, v are read where the projections leave
    them, the output is written where the out projection reads it), and it equals the same
    layer on the reference."""
    from torch.profiler import ProfilerActivity, profile

    from urpe.encodings import RelativeBias, ToeplitzGate
    from urpe.nn import MultiheadAttention

    dim, heads, length = 16, 4, 9
    position = RelativeBias(heads, length - 1)
    gate = ToeplitzGate(heads, length - 1, init="normal", init_mean=1.0, init_std=0.3)

    def layer(backend):
        torch.manual_seed(1)
        return MultiheadAttention(dim, heads, position=position, gate=gate, backend=backend)

    x = torch.randn(2, length, dim, generator=torch.Generator().manual_seed(0))
    fast = layer("cpp")
    with profile(activities=[ProfilerActivity.CPU]) as p:
        got = fast(x)
    copies = [e for e in p.events() if e.name in ("aten::copy_", "aten::clone")]
    assert [e.name for e in copies if not _inside(e, "aten::linear")] == []
    torch.testing.assert_close(got, layer("reference")(x))


def _inside(event, name: str) -> bool:
    while event is not None:
        if event.name == name:
            return True
        event = event.cpu_parent
    return False
