"""Prepared calls (`urpe.kernels.prepared`): checked and chosen once per kind of call, the same
results and the same refusals as a fresh call, chosen again whenever what they decided on
changes, and safe to share between threads."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch

from urpe.kernels import (
    BACKENDS,
    NORMALIZATIONS,
    AttentionCalls,
    Backend,
    BackendFailure,
    Decay,
    Relation,
    Toeplitz,
    attention,
    backends,
    dispatch,
    prepare,
    register_backend,
    register_normalization,
    registered,
    spec,
)
from urpe.kernels.spec import resolved

F64 = dict(dtype=torch.float64)


def _qkv(b=2, h=2, lq=5, lk=7, d=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, h, n, d, generator=gen, **F64) for n in (lq, lk, lk))


@pytest.fixture
def resolves(monkeypatch):
    """Counts the calls checked in full (resolve), from an empty memo."""
    dispatch.CALLS.clear()
    count = [0]

    def counted(arguments):
        count[0] += 1
        return resolved(arguments)

    monkeypatch.setattr(spec, "resolved", counted)
    yield count
    dispatch.CALLS.clear()


def test_a_repeated_call_is_resolved_once_and_gives_a_fresh_calls_result(resolves):
    q, k, v = _qkv()
    gate = Toeplitz(torch.randn(2, 9, **F64))
    mask = torch.rand(5, 7) > 0.3
    call = dict(gate=gate, attn_mask=mask, is_causal=True)
    first = attention(q, k, v, **call)
    assert resolves[0] == 1
    for seed in (1, 2):  # other tensors of the same kind: no checks, no choice again
        q2, k2, v2 = _qkv(seed=seed)
        table = torch.randn(2, 9, **F64)
        out = attention(q2, k2, v2, **{**call, "gate": Toeplitz(table)})
        expected = attention(q2, k2, v2, **{**call, "gate": Toeplitz(table)}, backend="reference")
        torch.testing.assert_close(out, expected)
    assert resolves[0] == 2  # the explicit reference call is a kind of its own
    torch.testing.assert_close(first, attention(q, k, v, **call, backend="reference"))


def test_leading_batch_dims_and_dense_terms_on_a_kept_call(resolves):
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, 2, 4, 4, generator=gen, **F64) for _ in range(3))
    bias = torch.randn(3, 1, 4, 4, **F64)  # broadcast over the first batch dim and the heads
    for _ in range(2):
        out = attention(q, k, v, bias=bias, key_padding_mask=torch.zeros(3, 4, dtype=torch.bool))
    assert resolves[0] == 1
    expected = attention(q, k, v, bias=bias, backend="reference")
    torch.testing.assert_close(out, expected)
    assert out.shape == (2, 3, 2, 4, 4)


def test_relation_indices_are_range_checked_on_every_call_of_a_kept_kind(resolves):
    q, k, v = _qkv()
    table = torch.randn(2, 3, **F64)
    attention(q, k, v, gate=Relation(table, torch.full((5, 7), 2)))
    attention(q, k, v, gate=Relation(table, torch.full((5, 7), 1)))
    assert resolves[0] == 1
    with pytest.raises(ValueError, match=r"gate index must lie in \[0, 3\)"):
        attention(q, k, v, gate=Relation(table, torch.full((5, 7), 3)))
    with pytest.raises(ValueError, match="Decay log_forget must be <= 0"):
        for sign in (-1.0, 1.0):  # kept at the first call, refused by its values at the second
            attention(q, k, v, bias=Decay(sign * torch.rand(2, 2, 7, **F64)))


# Pairs of calls that differ in one respect: the first is valid and kept, the second must still
# be refused with a fresh call's own error.
def _pairs():
    gate = Toeplitz(torch.randn(2, 9, **F64))
    ones = torch.ones(5, 7, dtype=torch.bool)
    return [
        (dict(attn_mask=ones), dict(attn_mask=torch.ones(5, 6, dtype=torch.bool))),
        (dict(attn_mask=ones), dict(attn_mask=torch.ones(5, 7, dtype=torch.int64))),
        (
            dict(key_padding_mask=torch.zeros(2, 7, dtype=torch.bool)),
            dict(key_padding_mask=torch.zeros(3, 7, dtype=torch.bool)),
        ),
        (dict(gate=gate), dict(gate=Toeplitz(torch.randn(3, 9, **F64)))),
        (dict(gate=gate), dict(gate=Toeplitz(torch.randn(2, 9)))),
        (dict(gate=gate, scale=1.0), dict(gate=gate, scale=True)),
        (dict(gate=gate, is_causal=False), dict(gate=gate, is_causal=0)),
        (dict(gate=gate, dropout_p=0.0), dict(gate=gate, dropout_p=1.5)),
        (dict(gate=gate, dropout_p=0.0), dict(gate=gate, dropout_p=False)),
        (dict(gate=gate), dict(gate=gate, normalization="nope")),
        (dict(gate=gate, scale=1.0), dict(gate=gate, scale=float("inf"))),
        (dict(gate=gate), dict(gate=gate, backend="nope")),
        (dict(gate=gate), dict(gate=gate, dropout_seed=1.5)),
        (dict(gate=gate, dropout_seed=3), dict(gate=gate, dropout_seed=torch.tensor([3]))),
        (
            dict(gate=Relation(torch.randn(2, 3, **F64), torch.full((5, 7), 2))),
            dict(gate=Relation(torch.randn(2, 3, **F64), torch.full((5, 7), 3))),
        ),
        (dict(bias=torch.randn(2, 5, 7, **F64)), dict(bias=torch.randn(2, 5, 6, **F64))),
        (dict(bias=torch.randn(2, 5, 7, **F64)), dict(bias=torch.ones(2, 5, 7, dtype=torch.int64))),
        (dict(document_ids=torch.zeros(7, dtype=torch.long)), dict(document_ids=torch.zeros(7))),
    ]


@pytest.mark.parametrize("index", range(len(_pairs())))
def test_what_a_fresh_call_refuses_is_refused_after_a_similar_call_was_kept(index):
    q, k, v = _qkv()
    valid, refused = _pairs()[index]
    dispatch.CALLS.clear()
    with pytest.raises((TypeError, ValueError)) as fresh:
        attention(q, k, v, **refused)
    attention(q, k, v, **valid)
    attention(q, k, v, **valid)
    with pytest.raises(type(fresh.value)) as warm:
        attention(q, k, v, **refused)
    assert str(warm.value) == str(fresh.value)


def test_a_registry_change_makes_kept_calls_choose_again():
    q, k, v = _qkv()
    dispatch.CALLS.clear()
    attention(q, k, v, backend="blockwise")
    ran = []

    def spy(spec):
        ran.append(spec)
        return BACKENDS["reference"].run(spec)

    with registered(register_backend, Backend("blockwise", spy)):
        attention(q, k, v, backend="blockwise")  # the kept call's backend was replaced
    assert len(ran) == 1
    attention(q, k, v, backend="blockwise")  # and restored: the spy no longer runs
    assert len(ran) == 1
    # a normalisation registered again with other formulas: the compiled kernels refuse it
    l2 = NORMALIZATIONS["l2"]
    attention(q, k, v, normalization="l2")
    with registered(register_normalization, l2.__class__(**{**l2.__dict__})):
        assert attention(q, k, v, normalization="l2").shape == (2, 2, 5, 4)
        chosen = dispatch.CALLS._prepared  # every kept call chose again under the new registry
        l2_calls = [p for p in chosen.values() if "l2" in p.kind]  # (its normalisation)
        assert l2_calls and all(p.backend.name != "cpp" for p in l2_calls)


def test_a_backend_that_fails_on_a_kept_call_hands_it_to_the_next(monkeypatch):
    q, k, v = _qkv()
    calls = []

    def flaky(spec):
        calls.append(spec)
        if len(calls) > 1:
            raise BackendFailure("stopped working")
        return BACKENDS["reference"].run(spec)

    dispatch.CALLS.clear()
    monkeypatch.setattr(backends, "BROKEN", backends.WatchedDict())
    with registered(register_backend, Backend("flaky-test", flaky, priority=10_000)):
        gate = Toeplitz(torch.randn(2, 9, **F64))
        attention(q, k, v, gate=gate)  # runs on flaky-test and is kept
        with pytest.warns(RuntimeWarning, match="flaky-test"):
            out = attention(q, k, v, gate=gate)  # its backend fails: the next one runs
        torch.testing.assert_close(out, attention(q, k, v, gate=gate, backend="reference"))
        assert ("flaky-test", "cpu") in backends.BROKEN


# A growing KV cache: one query against 2..40 keys, as decoding steps make them. Each entry
# builds the call's keyword arguments for Lk keys (masks and terms whose last dim is Lk).
def _decoding_calls():
    narrow = Toeplitz(torch.randn(2, 9, **F64))  # offsets beyond +-4 read the table's edges
    return {
        "toeplitz gate": lambda lk: dict(gate=narrow),
        "toeplitz bias and gate, causal": lambda lk: dict(bias=narrow, gate=narrow, is_causal=True),
        "float mask and padding": lambda lk: dict(
            gate=narrow,
            attn_mask=torch.linspace(-1, 1, lk, **F64).reshape(1, 1, 1, lk),
            key_padding_mask=torch.arange(lk).expand(2, lk) == 1,
        ),
        "dense bias": lambda lk: dict(bias=torch.linspace(-2, 2, 2 * lk, **F64).reshape(2, 1, lk)),
        "decay": lambda lk: dict(
            bias=Decay(-torch.linspace(0.1, 0.5, 2 * lk, **F64).reshape(1, 2, lk))
        ),
        "l2, bool mask": lambda lk: dict(
            gate=narrow, normalization="l2", attn_mask=torch.ones(1, lk, dtype=torch.bool)
        ),
        "documents, relu2": lambda lk: dict(
            gate=narrow, normalization="relu2", document_ids=torch.arange(lk) // 3
        ),
        "exp": lambda lk: dict(gate=narrow, normalization="exp"),
    }


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("case", list(_decoding_calls()))
def test_decoding_steps_with_a_growing_cache_are_resolved_once(resolves, case, grad):
    """A call prepared at one Lk serves the next steps (its kind leaves Lk out), and each
    step's result is a fresh call's."""
    arguments = _decoding_calls()[case]
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, 2, 1, 4, generator=gen, **F64, requires_grad=grad)
    cache = torch.randn(2, 2, 40, 4, generator=gen, **F64)
    with torch.set_grad_enabled(grad):
        for lk in range(2, 41):
            k, v = cache[:, :, :lk].contiguous(), cache[:, :, :lk].flip(-1).contiguous()
            out = attention(q, k, v, **arguments(lk))
            expected = attention(q, k, v, **arguments(lk), backend="reference")
            torch.testing.assert_close(out, expected)
            if grad:
                (got,) = torch.autograd.grad(out.sum(), q)
                (want,) = torch.autograd.grad(expected.sum(), q)
                torch.testing.assert_close(got, want)
    assert resolves[0] == 2  # the first step's call and its reference, nothing after


# Calls valid at 7 keys, then the same arguments at 8 keys, which a fresh call refuses: a kept
# call of the same kind must not let them through.
def _length_refusals():
    def keys(lk):
        return torch.zeros(2, 2, lk, 4, **F64)

    return [
        (dict(attn_mask=torch.ones(1, 7, dtype=torch.bool)), {}),
        (dict(key_padding_mask=torch.zeros(2, 7, dtype=torch.bool)), {}),
        (dict(bias=torch.zeros(2, 1, 7, **F64)), {}),
        (dict(bias=Decay(torch.zeros(2, 2, 7, **F64))), {}),
        (dict(document_ids=torch.zeros(2, 7, dtype=torch.long)), {}),
        ({}, dict(v=keys(9))),  # keys and values of different lengths
    ]


@pytest.mark.parametrize("index", range(len(_length_refusals())))
def test_a_call_at_another_length_is_refused_as_a_fresh_call_refuses_it(index):
    arguments, replaced = _length_refusals()[index]
    q = torch.zeros(2, 2, 1, 4, **F64)
    at_7 = dict(k=torch.zeros(2, 2, 7, 4, **F64), v=torch.zeros(2, 2, 7, 4, **F64))
    at_8 = dict(k=torch.zeros(2, 2, 8, 4, **F64), v=torch.zeros(2, 2, 8, 4, **F64))
    at_8.update(replaced)
    dispatch.CALLS.clear()
    with pytest.raises((TypeError, ValueError)) as fresh:
        attention(q, **at_8, **arguments)
    for _ in range(2):
        attention(q, **at_7, **arguments)
    with pytest.raises(type(fresh.value)) as warm:
        attention(q, **at_8, **arguments)
    assert str(warm.value) == str(fresh.value)


def test_a_prepared_call_runs_new_tensors_and_refuses_another_kind():
    q, k, v = _qkv()
    gate = Toeplitz(torch.randn(2, 9, **F64))
    call = prepare(q, k, v, gate=gate, is_causal=True, normalization="l2")
    assert call.backend.name in BACKENDS
    for lk in (7, 12, 3):  # any number of keys
        q2, k2, v2 = _qkv(lk=lk, seed=lk)
        out = call(q2, k2, v2, gate=gate)
        expected = attention(
            q2, k2, v2, gate=gate, is_causal=True, normalization="l2", backend="reference"
        )
        torch.testing.assert_close(out, expected)
    with pytest.raises(ValueError, match="made for other shapes"):
        call(*_qkv(lq=6), gate=gate)  # another number of queries
    with pytest.raises(ValueError, match="made for other shapes"):
        call(q, k, v, gate=torch.ones(2, 5, 7, **F64))  # another term kind
    with pytest.raises(ValueError, match="made for other shapes"):
        call(*(t.float() for t in (q, k, v)), gate=gate)  # another dtype


def test_a_prepared_call_holds_no_tensors():
    q, k, v = _qkv()
    gate = Toeplitz(torch.randn(2, 9, **F64))
    alive = [weakref.ref(t) for t in (q, k, v, gate.table)]
    call = prepare(q, k, v, gate=gate)
    del q, k, v, gate
    gc.collect()
    assert all(ref() is None for ref in alive)
    assert call.kind is not None


def test_a_memo_keeps_its_capacity_and_the_newest_kinds():
    calls = AttentionCalls(capacity=2)
    for lq in (1, 2, 3):
        calls(*_qkv(lq=lq))
    assert len(calls) == 2
    assert sorted(kind[0][2] for kind in calls._prepared) == [2, 3]
    with pytest.raises(ValueError, match="capacity"):
        AttentionCalls(capacity=0)


def test_threads_sharing_the_memo_get_their_own_results():
    """Many threads, many kinds, a memo smaller than the kinds (kept and evicted all the time):
    every call gives the reference's result and none raises."""
    calls = AttentionCalls(capacity=3)
    cases = []
    for i in range(8):
        q, k, v = _qkv(lq=1 + i % 4, lk=3 + i, seed=i)
        gate = Toeplitz(torch.randn(2, 9, **F64))
        expected = attention(q, k, v, gate=gate, is_causal=True, backend="reference")
        cases.append(((q, k, v), gate, expected))
    errors: list[BaseException] = []

    def work(offset: int) -> None:
        try:
            for n in range(60):
                (q, k, v), gate, expected = cases[(n + offset) % len(cases)]
                torch.testing.assert_close(calls(q, k, v, gate=gate, is_causal=True), expected)
        except BaseException as error:  # noqa: BLE001 - reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


def test_a_backend_registered_while_a_call_runs_is_asked_by_the_next_call():
    """Thread A is inside a call when the main thread registers a backend that "auto" puts
    first: A's call finishes on the backend it chose, and A's next call of the same kind runs
    on the new one; unregistered again, the one after runs without it."""
    q, k, v = _qkv()
    gate = Toeplitz(torch.randn(2, 9, **F64))
    inside, release = threading.Event(), threading.Event()
    ran: list[str] = []

    def slow(spec):
        ran.append("slow")
        inside.set()
        release.wait(10)
        return BACKENDS["reference"].run(spec)

    def first(spec):
        ran.append("first")
        return BACKENDS["reference"].run(spec)

    calls = AttentionCalls()
    results = []
    with registered(register_backend, Backend("slow-test", slow, priority=9_000)):
        thread = threading.Thread(target=lambda: results.append(calls(q, k, v, gate=gate)))
        thread.start()
        assert inside.wait(10)
        with registered(register_backend, Backend("first-test", first, priority=10_000)):
            release.set()
            thread.join()
            results.append(calls(q, k, v, gate=gate))
        results.append(calls(q, k, v, gate=gate))
    assert ran == ["slow", "first", "slow"]
    expected = attention(q, k, v, gate=gate, backend="reference")
    for out in results:
        torch.testing.assert_close(out, expected)


def test_a_prepared_call_keeps_its_backends_run_for_the_kind():
    """`Backend.prepare`: the C++ kernel works out its op's fixed arguments once per prepared
    call (not per call), and a growing cache still gives the reference's results."""
    from urpe.kernels.cpp import CppRun, unavailable
    from urpe.kernels.cpp import arguments as op_arguments

    if unavailable() is not None:
        pytest.skip("no C++ kernel")
    q, k, v = _qkv(b=1, h=2, lq=1, lk=40)
    gate = Toeplitz(torch.rand(2, 81, **F64) + 0.5)
    made = []
    original = op_arguments.OpArguments.__init__

    def counted(self, *args, **kwargs):
        made.append(1)
        original(self, *args, **kwargs)

    with torch.no_grad(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(op_arguments.OpArguments, "__init__", counted)
        prepared = prepare(q, k[:, :, :10], v[:, :, :10], is_causal=True, gate=gate)
        assert prepared.backend.name == "cpp"
        assert isinstance(prepared._choice[1], CppRun)
        for lk in range(10, 40, 7):  # a KV cache growing by some keys a step
            out = prepared(q, k[:, :, :lk], v[:, :, :lk], gate=gate)
            want = attention(
                q, k[:, :, :lk], v[:, :, :lk], is_causal=True, gate=gate, backend="reference"
            )
            torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    assert len(made) == 1
