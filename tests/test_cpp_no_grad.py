"""The C++ kernel's route for calls that need no gradient (decoding; `ops.NoGradForward`):
one op call that also finds NaN/inf, the same results as the reference, the non-finite rule
kept, and under torch.compile one opaque op."""

from __future__ import annotations

import pytest
import torch

from urpe.kernels import Decay, Relation, Toeplitz, attention, dispatch
from urpe.kernels.cpp import unavailable

from .cpp_calls import wrap_cpp_calls

pytestmark = pytest.mark.skipif(unavailable() is not None, reason="no C++ kernel")

F64 = dict(dtype=torch.float64)
OPAQUE = "urpe.cpp_guarded_forward_r2.default"


def _qkv(b=2, h=4, lq=1, lk=13, d=8, hkv=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = ((b, h, lq, d), (b, hkv or h, lk, d), (b, hkv or h, lk, d))
    return tuple(torch.randn(*s, generator=gen, **F64) for s in shapes)


@pytest.fixture
def checked_answers(monkeypatch):
    """Counts the calls `urpe_cpp::forward_if_finite` answered (found no NaN/inf), through the
    dispatcher or the Python entry."""
    dispatch.CALLS.clear()
    count = [0]

    def counting(name: str, route: str, function):
        if name != "forward_if_finite":
            return function

        def counted(*arguments):  # the function's (output, finite): an answer when finite
            out, finite = function(*arguments)
            count[0] += bool(finite)
            return out, finite

        return counted

    wrap_cpp_calls(monkeypatch, counting)
    yield count
    dispatch.CALLS.clear()


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
def test_decoding_calls_take_one_op_and_equal_the_reference(case, lq, lk, hkv, checked_answers):
    with torch.no_grad():
        for seed in range(3):  # the first call prepares, the next ones reuse: the same route
            q, k, v = _qkv(lq=lq, lk=lk, hkv=hkv, seed=seed)
            kwargs = _arguments(case, q, k, seed)
            out = attention(q, k, v, **kwargs, enable_gqa=hkv is not None)
            want = attention(q, k, v, **kwargs, enable_gqa=hkv is not None, backend="reference")
            torch.testing.assert_close(out, want)
    assert checked_answers[0] == 3


def test_a_nan_in_a_padded_key_still_stays_out_on_the_one_call_path(checked_answers):
    q, k, v = _qkv(lq=1)
    pad = torch.zeros(2, 13, dtype=torch.bool)
    pad[:, :2] = True
    gate = Toeplitz(torch.rand(4, 25, **F64) + 0.5)
    with torch.no_grad():
        attention(q, k, v, gate=gate, key_padding_mask=pad)  # answered by the checked op
        k[0, 1, 0, 0] = float("nan")  # padded
        v[1, 2, 1, 3] = float("inf")  # padded
        out = attention(q, k, v, gate=gate, key_padding_mask=pad)
        want = attention(q, k, v, gate=gate, key_padding_mask=pad, backend="reference")
        assert out.isfinite().all()
        torch.testing.assert_close(out, want)
        q[1, 3, 0, 0] = float("nan")  # a NaN query row gives a NaN output row
        out = attention(q, k, v, gate=gate, key_padding_mask=pad)
    assert out[1, 3].isnan().all() and out[0].isfinite().all()
    assert checked_answers[0] == 1  # non-finite inputs: the rule, then the unchecked forward


@pytest.mark.parametrize("where", ["bias", "float mask"])
def test_a_nan_in_a_term_acts_through_the_arithmetic_on_the_no_grad_route(where):
    """A NaN in a bias or float mask makes the checked op's outputs non-finite although q, k
    and v are finite: the call then runs unchecked, and gives the reference's NaN rows."""
    q, k, v = _qkv(lq=1)
    term = torch.zeros(2, 4, 1, 13, **F64)
    term[1, 2, 0, 5] = float("nan")
    call = dict(bias=term) if where == "bias" else dict(attn_mask=term)
    gate = Toeplitz(torch.rand(4, 25, **F64) + 0.5)
    with torch.no_grad():
        for _ in range(2):
            out = attention(q, k, v, gate=gate, **call)
    want = attention(q, k, v, gate=gate, **call, backend="reference")
    torch.testing.assert_close(out, want, equal_nan=True)
    assert out[1, 2].isnan().all() and out[0].isfinite().all()


def test_a_noncontiguous_or_expanded_toeplitz_table_works_on_every_call():
    """A column view and a (1 -> H) expanded table are valid tables: the first and every later
    call (no gradient, where the table may be read in place) take them (issue 39, item 24)."""
    q, k, v = _qkv(lq=1, lk=5)
    wide = torch.rand(25, 4, **F64).t()  # (4, 25), a transposed view
    shared = (torch.rand(1, 25, **F64) + 0.5).expand(4, 25)
    narrow = torch.rand(4, 9, 2, **F64)[..., 0]  # strided
    with torch.no_grad():
        for table in (wide, shared, narrow):
            assert not table.is_contiguous()
            want = attention(q, k, v, gate=Toeplitz(table), backend="reference")
            for _ in range(3):
                torch.testing.assert_close(attention(q, k, v, gate=Toeplitz(table)), want)


def test_calls_with_gradients_take_the_autograd_route_and_calls_without_the_checked_op(
    checked_answers,
):
    q, k, v = _qkv(lq=1)
    table = torch.rand(4, 25, **F64, requires_grad=True)
    for _ in range(2):
        out = attention(q, k, v, gate=Toeplitz(table))  # records the graph: not the checked op
        (grad,) = torch.autograd.grad(out.sum(), table)
        want = attention(q, k, v, gate=Toeplitz(table), backend="reference")
        (want_grad,) = torch.autograd.grad(want.sum(), table)
        torch.testing.assert_close(grad, want_grad)
    assert checked_answers[0] == 0
    with torch.no_grad():  # the same kind of call without gradients: the checked op
        for _ in range(2):
            attention(q, k, v, gate=Toeplitz(table))
        half = [t.to(torch.bfloat16) for t in (q, k, v)]
        attention(*half, gate=Toeplitz(table.detach().to(torch.bfloat16)))
        attention(q[None], k[None], v[None], gate=Toeplitz(table))  # two batch dims
    assert checked_answers[0] == 4
    with torch.no_grad():  # arguments it takes none for: checked up front, then the forward
        for normalization in ("exp", "relu2"):
            out = attention(q, k, v, gate=Toeplitz(table), normalization=normalization)
            want = attention(
                q, k, v, gate=Toeplitz(table), normalization=normalization, backend="reference"
            )
            torch.testing.assert_close(out, want)
        ids = torch.tensor([0] * 6 + [1] * 7)
        out = attention(q, k, v, gate=Toeplitz(table), document_ids=ids)
        want = attention(q, k, v, gate=Toeplitz(table), document_ids=ids, backend="reference")
        torch.testing.assert_close(out, want)
    assert checked_answers[0] == 4


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


def test_under_compile_a_relation_gate_takes_the_one_call_path(checked_answers):
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
    assert checked_answers[0] == 1


@pytest.mark.parametrize(("lq", "lk"), [(1, 13), (3, 11), (11, 11), (7, 4)])
def test_under_compile_toeplitz_terms_reach_the_opaque_op_as_tables(lq, lk):
    """The opaque op takes the tables as they are and keeps the rule where it must apply it (a
    NaN query, a NaN key): the same results as the reference."""
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
    assert (call.args[11], call.args[12]) == ("toeplitz", "toeplitz")  # bias_kind, gate_kind


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
