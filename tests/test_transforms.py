"""torch.func.grad, vmap, functional_call and torch.compile(fullgraph=True) on every backend.

Each test runs for every entry of the backend registry, on the richest call that backend accepts
(URPE's gate and a non-softmax normalisation where it can), and compares with plain eager
autograd on the same call.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from urpe.kernels import Relation, Toeplitz, attention, native_backends, select_backend

# The backends built for the CPU (the GPU ones have their own tests: test_triton, test_flex).
CPU_BACKENDS = native_backends("cpu")

F64 = dict(dtype=torch.float64)
B, H, L, D = 2, 2, 6, 4


def _inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, L, D, generator=gen, **F64) for _ in range(3))
    bias_table = torch.randn(H, 7, generator=gen, **F64) * 0.5
    gate_table = 1 + 0.3 * torch.randn(H, 5, generator=gen, **F64)
    return q, k, v, bias_table, gate_table


PADDING = torch.tensor([[False] * L, [False] * (L - 2) + [True] * 2])


def _call(name: str, bias_table, gate_table, padding=PADDING) -> dict:
    """The richest call the backend runs: URPE (Toeplitz B and C, l2) if it can, else softmax with
    the bias only. Masks: padding and causal."""
    q = torch.zeros(B, H, L, D, **F64)
    rich = dict(bias=Toeplitz(bias_table), gate=Toeplitz(gate_table), normalization="l2")
    try:
        select_backend(name, q, q, q, **rich)
        call = rich
    except ValueError:
        call = dict(bias=Toeplitz(bias_table))
    return call | dict(key_padding_mask=padding, is_causal=True)


def _run(name, q, k, v, bias_table, gate_table, padding=PADDING):
    return attention(q, k, v, **_call(name, bias_table, gate_table, padding), backend=name)


BACKEND_NAMES = CPU_BACKENDS


@pytest.mark.parametrize("name", BACKEND_NAMES)
def test_func_grad_equals_autograd(name):
    inputs = _inputs()
    weight = torch.randn(B, H, L, D, **F64)

    def loss(*args):
        return (_run(name, *args) * weight).sum()

    got = torch.func.grad(loss, argnums=tuple(range(5)))(*inputs)
    leaves = [t.clone().requires_grad_() for t in inputs]
    want = torch.autograd.grad(loss(*leaves), leaves, allow_unused=True)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, torch.zeros_like(g) if w is None else w)


@pytest.mark.parametrize("name", BACKEND_NAMES)
def test_vmap_equals_a_loop(name):
    q, k, v, bias_table, gate_table = _inputs()
    many_q = torch.randn(3, B, H, L, D, **F64)
    got = torch.func.vmap(lambda q: _run(name, q, k, v, bias_table, gate_table))(many_q)
    want = torch.stack([_run(name, x, k, v, bias_table, gate_table) for x in many_q])
    torch.testing.assert_close(got, want)
    # batched tables too: one bias table per example
    tables = bias_table + 0.1 * torch.randn(3, *bias_table.shape, **F64)
    got = torch.func.vmap(lambda t, q: _run(name, q, k, v, t, gate_table))(tables, many_q)
    want = torch.stack(
        [_run(name, x, k, v, t, gate_table) for t, x in zip(tables, many_q, strict=True)]
    )
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("name", BACKEND_NAMES)
def test_per_example_gradients_with_vmap_of_grad(name):
    """vmap(grad(f)) over examples: each example's gradient, for q and for the shared tables."""
    q, k, v, bias_table, gate_table = _inputs()

    def loss(q, k, v, bias_table, gate_table, padding):
        # one example: add the batch dim back
        out = _run(name, q[None], k[None], v[None], bias_table, gate_table, padding[None])
        return out.square().sum()

    argnums = (0, 3, 4)
    in_dims = (0, 0, 0, None, None, 0)
    got = torch.func.vmap(torch.func.grad(loss, argnums=argnums), in_dims=in_dims)(
        q, k, v, bias_table, gate_table, PADDING
    )
    for example in range(B):
        leaves = [t.clone().requires_grad_() for t in (q[example], bias_table, gate_table)]
        out = loss(leaves[0], k[example], v[example], leaves[1], leaves[2], PADDING[example])
        want = torch.autograd.grad(out, leaves, allow_unused=True)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g[example], torch.zeros_like(g[example]) if w is None else w)


class _TinyAttention(nn.Module):
    def __init__(self, backend: str):
        super().__init__()
        self.backend = backend
        self.proj = nn.Linear(D, 3 * D, dtype=torch.float64)
        self.bias_table = nn.Parameter(torch.randn(H, 7, **F64) * 0.5)
        self.gate_table = nn.Parameter(torch.ones(H, 5, **F64))

    def forward(self, x):  # x (B, H, L, D)
        q, k, v = self.proj(x).chunk(3, dim=-1)
        return _run(self.backend, q, k, v, self.bias_table, self.gate_table)


@pytest.mark.parametrize("name", BACKEND_NAMES)
def test_functional_call(name):
    module = _TinyAttention(name)
    x = torch.randn(B, H, L, D, **F64)
    params = {n: torch.randn_like(p) for n, p in module.named_parameters()}
    got = torch.func.functional_call(module, params, (x,))
    grads = torch.func.grad(lambda p: torch.func.functional_call(module, p, (x,)).sum())(params)
    module.load_state_dict(params)
    want = module(x)
    torch.testing.assert_close(got, want)
    want.sum().backward()
    for n, p in module.named_parameters():  # (SDPA has no gate: its table gets no gradient)
        want = torch.zeros_like(p) if p.grad is None else p.grad
        torch.testing.assert_close(grads[n], want, msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("name", BACKEND_NAMES)
def test_compile_fullgraph_matches_eager_with_dropout_and_checks(name):
    """One compiled graph per backend: it gives the eager result (output and gradients, dropout
    included), and the data-dependent checks still raise from inside it."""
    torch._dynamo.reset()  # f's code object is compiled once per backend: start each afresh
    q, k, v, bias_table, gate_table = _inputs()
    index = torch.randint(0, 7, (B, L, L))
    mask = torch.rand(L, L) < 0.8
    q_probe = torch.zeros(B, H, L, D, **F64)
    try:  # backends that take an explicit seed get one (a tensor); the others draw their own
        select_backend(name, q_probe, q_probe, q_probe, dropout_p=0.2, dropout_seed=1)
        explicit_seed = True
    except ValueError:
        explicit_seed = False
    rich = "gate" in _call(name, bias_table, gate_table)
    normalization = "exp" if rich else "softmax"

    def f(q, k, v, table, index, seed):
        extra = dict(gate=Toeplitz(gate_table), normalization=normalization) if rich else {}
        return attention(
            q,
            k,
            v,
            attn_mask=mask,
            bias=Relation(table, index),
            key_padding_mask=PADDING,
            is_causal=True,
            dropout_p=0.2,
            dropout_seed=seed if explicit_seed else None,
            backend=name,
            **extra,
        )

    compiled = torch.compile(f, fullgraph=True, dynamic=False)
    seed = torch.tensor(1234)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, bias_table)]
    with torch._inductor.config.patch(fallback_random=True):  # eager RNG where a seed is drawn
        torch.manual_seed(5)
        got = compiled(*leaves, index, seed)
        got_grads = torch.autograd.grad(got.sum(), leaves)
        torch.manual_seed(5)
        want = f(*leaves, index, seed)
        want_grads = torch.autograd.grad(want.sum(), leaves)
    torch.testing.assert_close(got, want)
    with torch.no_grad():
        plain = attention(
            q,
            k,
            v,
            attn_mask=mask,
            bias=Relation(bias_table, index),
            key_padding_mask=PADDING,
            is_causal=True,
            backend=name,
            **(dict(gate=Toeplitz(gate_table), normalization=normalization) if rich else {}),
        )
    assert not torch.allclose(got, plain)  # dropout took place
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w)
    bad = index.clone()
    bad[1, 2, 3] = 7
    with pytest.raises(ValueError, match="bias index must lie in"):
        compiled(q, k, v, bias_table, bad, seed)
    if normalization == "exp":
        with pytest.raises(ValueError, match="overflow"):
            compiled(q * 1e3, k * 1e3, v, bias_table, index, seed)
