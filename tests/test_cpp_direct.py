"""The C++ kernel's one-call path for remembered calls that need no gradient (decoding;
`urpe.kernels.cpp.direct`): the same results as the reference, the non-finite rule kept, and
taken only where it applies."""

from __future__ import annotations

import pytest
import torch

from urpe.kernels import Decay, Relation, Toeplitz, attention, plans
from urpe.kernels.cpp import unavailable
from urpe.kernels.cpp.direct import GUARDED

pytestmark = pytest.mark.skipif(unavailable() is not None, reason="no C++ kernel")

F64 = dict(dtype=torch.float64)
OPAQUE = f"urpe.{GUARDED}.default"


def _qkv(b=2, h=4, lq=1, lk=13, d=8, hkv=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = ((b, h, lq, d), (b, hkv or h, lk, d), (b, hkv or h, lk, d))
    return tuple(torch.randn(*s, generator=gen, **F64) for s in shapes)


@pytest.fixture
def direct_calls(monkeypatch):
    """Counts the calls the one-call path answered (from an empty plan cache)."""
    from urpe.kernels.cpp import direct

    plans.forget()
    direct.OPAQUE_CALLS.clear()
    count = [0]
    made = direct._forward_if_finite

    def counting():
        op = made()

        def counted(*arguments):  # the op's (output, finite): an answer when finite
            out, finite = op(*arguments)
            count[0] += bool(finite)
            return out, finite

        counted._op = counted  # the lean path calls the overload's own entry
        return counted

    monkeypatch.setattr(direct, "_forward_if_finite", counting)
    yield count
    plans.forget()
    direct.OPAQUE_CALLS.clear()


CASES = {
    "none": {},
    "gate": dict(gate="toeplitz"),
    "bias+gate": dict(bias="toeplitz", gate="toeplitz"),
    "dense bias": dict(bias="dense"),
    "l2": dict(gate="toeplitz", normalization="l2"),
    "padding": dict(gate="toeplitz", key_padding_mask=True),
    "bool mask": dict(gate="toeplitz", attn_mask="bool"),
    "float mask": dict(attn_mask="float"),
    "decay": dict(bias="decay", gate="toeplitz"),
    "decay, padding": dict(bias="decay", key_padding_mask=True),
}


def _arguments(case: dict, q, k, seed: int) -> dict:
    gen = torch.Generator().manual_seed(100 + seed)
    h, lq, lk = q.shape[1], q.shape[2], k.shape[2]
    out = {"is_causal": True, "normalization": case.get("normalization", "softmax")}
    for name in ("bias", "gate"):
        kind = case.get(name)
        if kind == "toeplitz":  # a table narrower than the offsets: clamped columns too
            out[name] = Toeplitz(torch.rand(h, 2 * 6 + 1, generator=gen, **F64) + 0.5)
        elif kind == "dense":
            out[name] = torch.randn(q.shape[0], h, lq, lk, generator=gen, **F64)
        elif kind == "decay":  # FoX decoding: log f of every cached key
            out[name] = Decay(-torch.rand(q.shape[0], h, lk, generator=gen, **F64))
    if case.get("key_padding_mask"):
        mask = torch.zeros(q.shape[0], lk, dtype=torch.bool)
        mask[0, :3] = True
        out["key_padding_mask"] = mask
    if case.get("attn_mask") == "bool":
        out["attn_mask"] = torch.rand(lq, lk, generator=gen) > 0.3
    elif case.get("attn_mask") == "float":
        out["attn_mask"] = torch.randn(q.shape[0], 1, lq, lk, generator=gen, **F64)
    return out


@pytest.mark.parametrize("case", CASES.values(), ids=CASES)
@pytest.mark.parametrize("lq,lk,hkv", [(1, 13, None), (3, 13, 2), (16, 40, None)])
def test_decoding_calls_take_one_op_and_equal_the_reference(case, lq, lk, hkv, direct_calls):
    with torch.no_grad():
        for seed in range(3):  # the first call makes the plan, the next ones use it
            q, k, v = _qkv(lq=lq, lk=lk, hkv=hkv, seed=seed)
            kwargs = _arguments(case, q, k, seed)
            out = attention(q, k, v, **kwargs, enable_gqa=hkv is not None)
            want = attention(q, k, v, **kwargs, enable_gqa=hkv is not None, backend="reference")
            torch.testing.assert_close(out, want)
    assert direct_calls[0] == 2


def test_a_nan_in_a_padded_key_still_stays_out_on_the_one_call_path(direct_calls):
    q, k, v = _qkv(lq=1)
    pad = torch.zeros(2, 13, dtype=torch.bool)
    pad[:, :2] = True
    gate = Toeplitz(torch.rand(4, 25, **F64) + 0.5)
    with torch.no_grad():
        attention(q, k, v, gate=gate, key_padding_mask=pad)  # the plan
        k[0, 1, 0, 0] = float("nan")  # padded
        v[1, 2, 1, 3] = float("inf")  # padded
        out = attention(q, k, v, gate=gate, key_padding_mask=pad)
        want = attention(q, k, v, gate=gate, key_padding_mask=pad, backend="reference")
        assert out.isfinite().all()
        torch.testing.assert_close(out, want)
        q[1, 3, 0, 0] = float("nan")  # a NaN query row gives a NaN output row
        out = attention(q, k, v, gate=gate, key_padding_mask=pad)
    assert out[1, 3].isnan().all() and out[0].isfinite().all()
    assert direct_calls[0] == 0  # non-finite inputs: the general path, which applies the rule


def test_calls_that_need_gradients_or_other_forms_take_the_general_path(direct_calls):
    q, k, v = _qkv(lq=1)
    table = torch.rand(4, 25, **F64, requires_grad=True)
    for _ in range(2):
        out = attention(q, k, v, gate=Toeplitz(table))  # records the graph: not direct
        (grad,) = torch.autograd.grad(out.sum(), table)
        want = attention(q, k, v, gate=Toeplitz(table), backend="reference")
        (want_grad,) = torch.autograd.grad(want.sum(), table)
        torch.testing.assert_close(grad, want_grad)
    with torch.no_grad():
        for normalization in ("exp", "relu2"):  # counted up front, or overflow-checked
            for _ in range(2):
                attention(q, k, v, gate=Toeplitz(table), normalization=normalization)
        half = [t.to(torch.bfloat16) for t in (q, k, v)]
        for _ in range(2):
            attention(*half, gate=Toeplitz(table.detach().to(torch.bfloat16)))
        for _ in range(2):
            attention(q[None], k[None], v[None], gate=Toeplitz(table))  # two batch dims
    assert direct_calls[0] == 0
    with torch.no_grad():  # the plan made with gradients serves calls without them
        for _ in range(2):
            attention(q, k, v, gate=Toeplitz(table))
    assert direct_calls[0] == 2


def _compiled_calls(fn):
    """fn compiled whole (aot_eager: the graph as traced) and the ops of its graphs."""
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend=counter)
    return compiled, lambda: [
        str(node.target)
        for graph in counter.graphs
        for node in graph.graph.nodes
        if node.op == "call_function"
    ]


def test_under_compile_a_call_without_gradients_is_one_opaque_op_that_keeps_the_rule():
    q, k, v = _qkv(lq=1)
    pad = torch.zeros(2, 13, dtype=torch.bool)
    pad[:, :2] = True
    table = torch.rand(4, 25, **F64) + 0.5

    def step(q, k, v, table, pad):
        return attention(q, k, v, gate=Toeplitz(table), key_padding_mask=pad, is_causal=True)

    compiled, ops = _compiled_calls(step)
    with torch.no_grad():
        for poison in (False, True):
            if poison:  # padded: the rule keeps them out, inside the op
                k[0, 1, 0, 0] = float("nan")
                v[1, 2, 1, 3] = float("inf")
            out = compiled(q, k, v, table, pad)
            want = attention(
                q, k, v, gate=Toeplitz(table), key_padding_mask=pad, backend="reference"
            )
            torch.testing.assert_close(out, want)
            assert out.isfinite().all()
    called = ops()
    assert called.count(OPAQUE) == 1
    assert not any("isfinite" in op or "where" in op for op in called), called


def test_under_compile_a_call_with_gradients_keeps_the_differentiable_path():
    q, k, v = _qkv(lq=2)
    table = (torch.rand(4, 25, **F64) + 0.5).requires_grad_()
    compiled, ops = _compiled_calls(lambda q, k, v, t: attention(q, k, v, gate=Toeplitz(t)))
    (grad,) = torch.autograd.grad(compiled(q, k, v, table).sum(), table)
    want = attention(q, k, v, gate=Toeplitz(table), backend="reference")
    (want_grad,) = torch.autograd.grad(want.sum(), table)
    torch.testing.assert_close(grad, want_grad)
    assert OPAQUE not in ops()


def test_under_compile_a_relation_gate_takes_the_one_call_path(direct_calls):
    """A static KV cache gives tensor positions, so the gate is a Relation: the opaque op runs it
    in one call too (not the general eager path)."""
    q, k, v = _qkv(lq=1)
    table = torch.rand(4, 9, **F64) + 0.5
    index = torch.randint(0, 9, (1, 1, 13))

    def step(q, k, v, table, index):
        return attention(q, k, v, gate=Relation(table, index))

    compiled, ops = _compiled_calls(step)
    with torch.no_grad():
        out = compiled(q, k, v, table, index)
    want = attention(q, k, v, gate=Relation(table, index), backend="reference")
    torch.testing.assert_close(out, want)
    assert OPAQUE in ops()
    assert direct_calls[0] == 1


def test_under_compile_the_opaque_op_builds_its_one_call_path_once_per_signature(
    direct_calls, monkeypatch
):
    """Decoding steps call the opaque op with the same kind of arguments in every layer and
    step: its body looks the one-call path up by signature instead of rebuilding the spec and
    the closure on each call (a new signature builds its own)."""
    from urpe.kernels.cpp import direct

    builds = []
    made = direct.raw_direct_call
    monkeypatch.setattr(direct, "raw_direct_call", lambda *a: builds.append(1) or made(*a))
    table = torch.rand(4, 9, **F64) + 0.5
    compiled, _ = _compiled_calls(lambda q, k, v, t: attention(q, k, v, gate=Toeplitz(t)))
    with torch.no_grad():
        for seed in range(3):
            q, k, v = _qkv(lq=1, seed=seed)
            want = attention(q, k, v, gate=Toeplitz(table), backend="reference")
            torch.testing.assert_close(compiled(q, k, v, table), want)
        assert (len(builds), direct_calls[0]) == (1, 3)
        q, k, v = _qkv(lq=1, lk=7)
        want = attention(q, k, v, gate=Toeplitz(table), backend="reference")
        torch.testing.assert_close(compiled(q, k, v, table), want)
    assert (len(builds), direct_calls[0]) == (2, 4)


@pytest.mark.parametrize(("lq", "lk"), [(1, 13), (3, 11), (11, 11), (7, 4)])
def test_under_compile_a_toeplitz_term_reaches_the_opaque_op_read_out_in_the_graph(lq, lk):
    """The graph reads the table out at the call's offsets (the rows the C++ loops read), so
    the op's body gathers nothing per call; where the rule needs the general path (a NaN
    query, a NaN key) the table comes back from the rows: the same results as the reference."""
    from urpe.kernels.cpp.direct import ROWS

    gen = torch.Generator().manual_seed(3)
    gate = torch.rand(4, 2 * 6 + 1, generator=gen, **F64) + 0.5
    bias = torch.randn(4, 2 * 2 + 1, generator=gen, **F64)

    def step(q, k, v, gate, bias):
        return attention(q, k, v, gate=Toeplitz(gate), bias=Toeplitz(bias), is_causal=True)

    graphs = []
    compiled = torch.compile(step, fullgraph=True, backend=lambda g, _: graphs.append(g) or g)
    q, k, v = _qkv(lq=lq, lk=lk)
    with torch.no_grad():
        for poison in (False, True):
            if poison:
                q[0, 1, 0, 2] = float("nan")
                k[1, 3, 0, 1] = float("nan")
            out = compiled(q, k, v, gate, bias)
            want = attention(
                q,
                k,
                v,
                gate=Toeplitz(gate),
                bias=Toeplitz(bias),
                is_causal=True,
                backend="reference",
            )
            torch.testing.assert_close(out, want, equal_nan=True)
            assert out.isnan().any() == poison
    (call,) = [n for n in graphs[0].graph.nodes if str(n.target) == OPAQUE]
    assert (call.args[11], call.args[12]) == (ROWS, ROWS)  # bias_kind, gate_kind


def _term_cases(lq: int, lk: int) -> dict:
    gen = torch.Generator().manual_seed(5)
    return {
        "dense bias": dict(bias=torch.randn(1, 4, lq, lk, generator=gen, **F64)),
        "toeplitz gate": dict(gate=Toeplitz(torch.rand(4, 2 * lk - 1, generator=gen, **F64))),
        "relation gate": dict(
            gate=Relation(
                torch.rand(4, 7, generator=gen, **F64) + 0.5,
                torch.randint(0, 7, (1, lq, lk), generator=gen),
            )
        ),
        "decay bias": dict(bias=Decay(-torch.rand(2, 4, lk, generator=gen, **F64))),
        "documents": dict(document_ids=torch.tensor([0] * 5 + [1] * (lk - 5)).expand(2, lk)),
    }


@pytest.mark.parametrize("term", list(_term_cases(3, 11)))
def test_under_compile_every_term_kind_matches_the_reference_without_gradients(term):
    """The opaque op of compiled no-grad calls rebuilds each term from its kind: a Decay's
    log_forget once came back as a dense bias of the wrong shape."""
    q, k, v = _qkv(lq=3, lk=11)
    terms = _term_cases(3, 11)[term]
    compiled = torch.compile(
        lambda q, k, v: attention(q, k, v, is_causal=True, **terms), fullgraph=True
    )
    with torch.no_grad():
        out = compiled(q, k, v)
    want = attention(q, k, v, is_causal=True, backend="reference", **terms)
    torch.testing.assert_close(out, want)
