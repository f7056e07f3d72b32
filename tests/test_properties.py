"""Property-based: every backend against the reference over random calls (Hypothesis).

The strategy draws a whole call: leading batch dims, heads (grouped or not), Lq != Lk, length 1,
odd lengths, head widths, every normalisation in the registry, every bias/gate form (none, dense
with any broadcast shape, Toeplitz with K below and above the length, Relation with a per-batch
or shared index, shared-head tables, a Decay bias where Lq = Lk), masks (padding with fully
padded rows, causal, bool or float attn_mask with rows where nothing is visible, packed
documents where Lq = Lk), q, k, v contiguous or as views of (..., L, H, D) projections, dtype
(float64 exactly; float32 and bfloat16 with tolerances). Every backend in the registry that
accepts the call runs it (the tiled kernels, blockwise and cpp, also with random small tiles),
forward and gradients, against the reference.

Bounded for CI: a fixed number of examples, derandomized (the same examples every run).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from urpe.kernels import (
    NORMALIZATIONS,
    Decay,
    Relation,
    Toeplitz,
    attention,
    native_backends,
    select_backend,
)
from urpe.kernels.blockwise import blockwise_attention
from urpe.kernels.cpp import cpp_attention

# The backends built for the CPU (the GPU ones have their own tests: test_triton, test_flex).
CPU_BACKENDS = native_backends("cpu")
# The tiled kernels, run again with the drawn tile sizes.
TILED = {"blockwise": blockwise_attention, "cpp": cpp_attention}

CI = settings(
    max_examples=120,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
TOLERANCE = {
    torch.float64: dict(rtol=1e-9, atol=1e-10),
    torch.float32: dict(rtol=2e-4, atol=2e-5),
    torch.bfloat16: dict(rtol=3e-2, atol=3e-2),
}


@st.composite
def calls(draw) -> dict:
    """The choices that make up one random attention call (see `build`)."""
    batch = tuple(draw(st.lists(st.integers(1, 3), min_size=0, max_size=2)))
    kv_heads = draw(st.integers(1, 3))
    heads = kv_heads * draw(st.sampled_from([1, 1, 2]))
    lq = draw(st.integers(1, 9))
    lk = lq if draw(st.booleans()) else draw(st.integers(1, 9))  # (Decay, documents: Lq = Lk)
    full = (*batch, heads, lq, lk)

    def term(role: str):
        kinds = ["none", "dense", "toeplitz", "relation"]
        if role == "bias" and lq == lk:
            kinds.append("decay")  # (B|1, H|1, Lk) log forget gates
        kind = draw(st.sampled_from(kinds))
        if kind == "decay":
            return kind, (*(n if draw(st.booleans()) else 1 for n in batch), heads, lk)
        if kind == "dense":  # any broadcast shape: fewer leading dims, some dims 1
            rank = draw(st.integers(2, len(full)))
            return kind, tuple(n if draw(st.booleans()) else 1 for n in full[len(full) - rank :])
        if kind == "toeplitz":  # K from 0 to beyond the length; one table row or one per head
            return kind, (draw(st.sampled_from([1, heads])), 2 * draw(st.integers(0, 10)) + 1)
        if kind == "relation":  # index per batch row or shared
            table = (draw(st.sampled_from([1, heads])), draw(st.integers(1, 6)))
            return kind, (table, batch if draw(st.booleans()) else ())
        return kind, None

    return dict(
        seed=draw(st.integers(0, 2**31 - 1)),
        dtype=draw(st.sampled_from([torch.float64] * 4 + [torch.float32, torch.bfloat16])),
        batch=batch,
        heads=heads,
        kv_heads=kv_heads,
        lq=lq,
        lk=lk,
        d=draw(st.sampled_from([1, 3, 8])),
        dv=draw(st.sampled_from([1, 2, 5])),
        normalization=draw(st.sampled_from(sorted(NORMALIZATIONS))),
        causal=draw(st.booleans()),
        bias=term("bias"),
        gate=term("gate"),
        documents=draw(st.booleans()) and lq == lk,
        projected=draw(st.booleans()),  # q, k, v as views of (..., L, H, D) tensors
        padding=draw(st.sampled_from(["none", "random", "with an empty row"])),
        mask=draw(st.sampled_from(["none", "bool", "float"])),
        mask_rank=draw(st.integers(2, len(full))),
        tiles=(draw(st.integers(1, 5)), draw(st.integers(1, 7))),
    )


def build(c: dict, dtype: torch.dtype):
    """q, k, v, the call's keyword arguments and its differentiable leaves. Values are drawn in
    float64, rounded to c["dtype"] and handed over in `dtype`: the same numbers in any dtype."""
    gen = torch.Generator().manual_seed(c["seed"])
    batch, full = c["batch"], (*c["batch"], c["heads"], c["lq"], c["lk"])

    def randn(*shape, scale=1.0, shift=0.0):
        x = torch.randn(*shape, generator=gen, dtype=torch.float64) * scale + shift
        return x.to(c["dtype"]).to(dtype).requires_grad_()

    def operand(heads: int, length: int, width: int):
        """(..., heads, length, width); with c["projected"] a view of a (..., length, heads,
        width) leaf, as a model's projection gives it (the gradient reaches that leaf)."""
        if not c.get("projected"):
            leaf = randn(*batch, heads, length, width)
            return leaf, leaf
        leaf = randn(*batch, length, heads, width)
        return leaf.transpose(-3, -2), leaf

    (q, q_leaf), (k, k_leaf), (v, v_leaf) = (
        operand(c["heads"], c["lq"], c["d"]),
        operand(c["kv_heads"], c["lk"], c["d"]),
        operand(c["kv_heads"], c["lk"], c["dv"]),
    )
    leaves = [q_leaf, k_leaf, v_leaf]
    call = dict(normalization=c["normalization"], is_causal=c["causal"])
    if c["normalization"] == "exp":
        call["scale"] = 0.1  # no denominator: stay well inside the range
    if c["heads"] != c["kv_heads"]:
        call["enable_gqa"] = True
    for role in ("bias", "gate"):
        kind, shape = c[role]
        shift = 1.0 if role == "gate" else 0.0
        if kind == "dense":
            call[role] = randn(*shape, scale=0.5, shift=shift)
            leaves.append(call[role])
        elif kind == "toeplitz":
            call[role] = Toeplitz(randn(*shape, scale=0.5, shift=shift))
            leaves.append(call[role].table)
        elif kind == "relation":
            (table_heads, relations), index_batch = shape
            index = torch.randint(0, relations, (*index_batch, c["lq"], c["lk"]), generator=gen)
            call[role] = Relation(randn(table_heads, relations, scale=0.5, shift=shift), index)
            leaves.append(call[role].table)
        elif kind == "decay":  # log f = logsigmoid(x) <= 0
            x = torch.randn(*shape, generator=gen, dtype=torch.float64) + 2.0
            log_forget = torch.nn.functional.logsigmoid(x).to(c["dtype"]).to(dtype)
            call[role] = Decay(log_forget.requires_grad_())
            leaves.append(call[role].log_forget)
    if c.get("documents"):  # packed: sorted ids, a query sees the keys of its own document
        ids = torch.randint(0, 3, (*batch, c["lk"]), generator=gen).sort(-1).values
        call["document_ids"] = ids
    if c["padding"] != "none":
        padding = torch.rand(*batch, c["lk"], generator=gen) < 0.3
        if c["padding"] == "with an empty row" and batch:
            padding[(0,) * len(batch)] = True  # a batch row with every key padded
        call["key_padding_mask"] = padding
    if c["mask"] != "none":
        shape = full[len(full) - c["mask_rank"] :]
        hidden = torch.rand(shape, generator=gen) < 0.3
        if shape[-2] > 1:
            hidden[..., 0, :] = True  # a query row with nothing visible
        if c["mask"] == "bool":
            call["attn_mask"] = ~hidden
        else:
            call["attn_mask"] = randn(*shape, scale=0.5).detach()
            call["attn_mask"] = call["attn_mask"].masked_fill(hidden, float("-inf"))
            call["attn_mask"].requires_grad_()
            leaves.append(call["attn_mask"])
    return q, k, v, call, leaves


def _accepting(q, k, v, call) -> list[str]:
    names = []
    for name in CPU_BACKENDS:
        try:
            select_backend(name, q, k, v, **call)
        except ValueError:
            continue
        names.append(name)
    return names


def _output_and_grads(fn, c: dict, dtype: torch.dtype):
    q, k, v, call, leaves = build(c, dtype)
    out = fn(q, k, v, **call)
    weight = torch.linspace(-1, 1, out.numel(), dtype=torch.float64).view_as(out).to(out.dtype)
    grads = torch.autograd.grad((out * weight).sum(), leaves, allow_unused=True)
    grads = [torch.zeros_like(t) if g is None else g for g, t in zip(grads, leaves, strict=True)]
    return out, grads


@pytest.mark.slow
@CI
@given(calls())
def test_every_backend_matches_the_reference(c):
    dtype = c["dtype"]
    # the reference in float64 on the same (rounded) numbers is the target for every dtype
    want, want_grads = _output_and_grads(
        lambda *a, **k: attention(*a, **k, backend="reference"), c, torch.float64
    )
    q, k, v, call, _ = build(c, dtype)
    names = _accepting(q, k, v, call)
    runners = [(n, lambda *a, n=n, **kw: attention(*a, **kw, backend=n)) for n in names]
    block_q, block_k = c["tiles"]
    for name in (n for n in TILED if n in names):
        tiled = lambda *a, n=name, **kw: TILED[n](*a, **kw, block_q=block_q, block_k=block_k)  # noqa: E731
        runners.append((f"{name}-tiled", tiled))
    assert "reference" in names
    tol = TOLERANCE[dtype]
    for name, fn in runners:
        out, grads = _output_and_grads(fn, c, dtype)
        assert out.dtype == dtype
        scale = max(1.0, want.abs().max().item() if want.numel() else 1.0)
        torch.testing.assert_close(
            out.double() / scale, want / scale, **tol, msg=lambda m, n=name: f"{n} output: {m}"
        )
        for i, (g, w) in enumerate(zip(grads, want_grads, strict=True)):
            scale = max(1.0, w.abs().max().item() if w.numel() else 1.0)
            if dtype != torch.float64:  # a table's gradient sums many rounded terms
                scale *= math.sqrt(max(1, w.numel()))
            torch.testing.assert_close(
                g.double() / scale,
                w / scale,
                **tol,
                msg=lambda m, n=name, i=i: f"{n} grad {i}: {m}",
            )
