"""The C++ kernel's Python entry (entry.cpp): a call that needs no gradient runs
`forward_if_finite` without torch's dispatcher in plain eager mode, with the reference's results,
and only there: a dispatch mode, a function mode, a tensor subclass, a torch.func transform, a
gradient, torch.compile's tracing and the profiler all see the op as before."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from urpe.kernels import Toeplitz, attention, dispatch
from urpe.kernels.cpp import build, unavailable

from .cpp_calls import wrap_cpp_calls

pytestmark = pytest.mark.skipif(unavailable() is not None, reason="no C++ kernel")

F64 = dict(dtype=torch.float64)
OP = "urpe_cpp.forward_if_finite.default"


def _decoding(seed: int = 0, lk: int = 13):
    """q (2, 4, 1, 8), k, v (2, 4, lk, 8) and a Toeplitz gate, float64."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, 1, 8, generator=gen, **F64)
    k, v = (torch.randn(2, 4, lk, 8, generator=gen, **F64) for _ in range(2))
    return q, k, v, Toeplitz(torch.rand(4, 2 * 6 + 1, generator=gen, **F64) + 0.5)


@pytest.fixture
def calls(monkeypatch):
    """The routes ("op", "entry") by which `forward_if_finite` was called, in order."""
    seen: list[str] = []

    def recording(name: str, via: str, function):
        if name != "forward_if_finite":
            return function

        def recorded(*arguments):
            seen.append(via)
            return function(*arguments)

        return recorded

    dispatch.CALLS.clear()
    wrap_cpp_calls(monkeypatch, recording)
    yield seen
    dispatch.CALLS.clear()


def test_the_loaded_kernel_has_its_python_entry():
    entry = build.python_entry()
    assert entry is not None and callable(entry.forward_if_finite), build._state.get("entry")


@pytest.mark.parametrize("terms", ["none", "gate", "gate, padding, float mask"])
def test_calls_without_gradients_take_the_entry_and_equal_the_reference(terms, calls):
    q, k, v, gate = _decoding()
    kwargs = {"is_causal": True}
    if terms != "none":
        kwargs["gate"] = gate
    if "padding" in terms:
        kwargs["key_padding_mask"] = torch.arange(13).expand(2, 13) < 2
        kwargs["attn_mask"] = torch.randn(2, 1, 1, 13, **F64)
    with torch.no_grad():
        for _ in range(3):  # the first call prepares, the others reuse
            out = attention(q, k, v, **kwargs)
    torch.testing.assert_close(out, attention(q, k, v, **kwargs, backend="reference"))
    assert calls == ["entry"] * 3


def test_a_nan_found_by_the_entry_keeps_the_rule(calls):
    q, k, v, gate = _decoding()
    k[1, 2, 4, 0] = float("nan")
    with torch.no_grad():
        out = attention(q, k, v, gate=gate, is_causal=True)
    want = attention(q, k, v, gate=gate, is_causal=True, backend="reference")
    torch.testing.assert_close(out, want, equal_nan=True)
    assert out[1, 2].isnan().all() and out[0].isfinite().all()
    assert calls == ["entry"]  # it answered "not finite": the rule then ran without it


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


class _Functions(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


# what each mode sees of the op: a function mode the op; a dispatch mode what its kernel calls
# (a CompositeImplicitAutograd kernel: torch.library's default for a function given to `def`)
SEEN = {_Ops: "aten.empty.memory_format", _Functions: "urpe_cpp.forward_if_finite"}


@pytest.mark.parametrize("mode", [_Ops, _Functions], ids=["dispatch mode", "function mode"])
def test_a_mode_sees_the_op(mode, calls):
    q, k, v, gate = _decoding()
    want = attention(q, k, v, gate=gate, is_causal=True, backend="reference")
    with torch.no_grad():
        attention(q, k, v, gate=gate, is_causal=True)  # prepared outside the mode
        with mode() as watching:
            out = attention(q, k, v, gate=gate, is_causal=True)
    torch.testing.assert_close(out, want)
    assert calls == ["entry", "op"]
    assert any(SEEN[mode] in name for name in watching.seen), watching.seen


class _Logged(torch.Tensor):
    """A subclass that logs the functions called on it (as a tracing library's would)."""

    log: list = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.log.append(getattr(func, "__name__", str(func)))
        return super().__torch_function__(func, types, args, kwargs or {})


def test_a_tensor_subclass_sees_the_op(calls):
    q, k, v, gate = _decoding()
    _Logged.log = []
    with torch.no_grad():
        out = attention(q.as_subclass(_Logged), k, v, gate=gate, is_causal=True)
        gated_only = attention(q, k, v, gate=Toeplitz(gate.table.as_subclass(_Logged)))
    torch.testing.assert_close(
        out.as_subclass(torch.Tensor),
        attention(q, k, v, gate=gate, is_causal=True, backend="reference"),
    )
    torch.testing.assert_close(
        gated_only.as_subclass(torch.Tensor), attention(q, k, v, gate=gate, backend="reference")
    )
    assert calls == ["op", "op"] and "forward_if_finite.default" in _Logged.log


def test_vmap_and_gradients_do_not_take_the_entry(calls):
    q, k, v, gate = _decoding()
    with torch.no_grad():
        out = torch.func.vmap(lambda q, k, v: attention(q, k, v, gate=gate))(q, k, v)
    want = attention(q, k, v, gate=gate, backend="reference")
    torch.testing.assert_close(out, want)
    table = gate.table.clone().requires_grad_()
    out = attention(q, k, v, gate=Toeplitz(table), is_causal=True)
    assert out.grad_fn is not None
    assert "entry" not in calls


def test_the_profiler_records_the_op(calls):
    q, k, v, gate = _decoding()
    with (
        torch.no_grad(),
        torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof,
    ):
        attention(q, k, v, gate=gate, is_causal=True)
    assert calls == ["op"]
    assert any(event.name == "urpe_cpp::forward_if_finite" for event in prof.events())


def test_under_compile_the_entry_runs_only_inside_the_opaque_op(calls):
    """torch.compile traces the opaque no-grad op (`ops.GUARDED_FORWARD`), never the entry; the
    compiled graph then runs the op's body eagerly, which takes the entry."""
    q, k, v, gate = _decoding()
    traced = []
    compiled = torch.compile(
        lambda q, k, v: attention(q, k, v, gate=gate, is_causal=True),
        fullgraph=True,
        backend=lambda graph, _: traced.append(calls.copy()) or graph,
    )
    torch._dynamo.reset()
    with torch.no_grad():
        out = compiled(q, k, v)
    torch.testing.assert_close(
        out, attention(q, k, v, gate=gate, is_causal=True, backend="reference")
    )
    assert traced == [[]] and calls == ["entry"]


def test_the_entry_checks_its_arguments_as_the_op_does():
    """The same checks (library.cpp): a wrong argument raises, naming it; a wrong type too."""
    q, k, v, _ = _decoding()
    entry = build.python_entry().forward_if_finite
    scalars = (0, None, None, 0, None, None, None, None, None, True, 0, 0.5, 256, 512)
    out, finite = entry(q, k, v, *scalars)
    torch.testing.assert_close(
        out, attention(q, k, v, is_causal=True, scale=0.5, backend="reference")
    )
    assert finite
    with pytest.raises(RuntimeError, match="urpe_cpp: q .* do not agree"):
        entry(q, k[..., :5], v, *scalars)
    with pytest.raises(TypeError):
        entry(q, "k", v, *scalars)
