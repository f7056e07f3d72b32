"""No host reads on accelerators: the code that runs where reading a tensor's value would make
the host wait for the device (CUDA; see `urpe.kernels.host`) never reads one, in the forward or
the backward pass of any backend.

Without a GPU this runs that code on the CPU: `host.READABLE` is emptied (the CPU is treated as
an accelerator) and every way of reading a value from Python raises. On a GPU, tests/gpu adds
`torch.cuda.set_sync_debug_mode("error")` and a CUDA-graph capture of a decode step.
"""

from __future__ import annotations

import contextlib
import itertools

import pytest
import torch

from urpe.kernels import Decay, Relation, Toeplitz, attention, dispatch, host, native_backends

F64 = dict(dtype=torch.float64)
B, H, L, D = 2, 2, 7, 4


class HostRead(AssertionError):
    """A tensor's value was read on the host."""


def _refuse(name: str):
    def method(self, *args, **kwargs):
        raise HostRead(f"Tensor.{name} read a value on the host")

    return method


READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy")


@contextlib.contextmanager
def no_host_reads():
    """The accelerators' code path on the CPU, with every value read refused."""
    saved = set(host.READABLE)
    host.READABLE.clear()
    dispatch.CALLS.clear()
    originals = {name: getattr(torch.Tensor, name) for name in READS}
    try:
        for name in READS:
            setattr(torch.Tensor, name, _refuse(name))
        yield
    finally:
        for name, method in originals.items():
            setattr(torch.Tensor, name, method)
        host.READABLE.update(saved)
        dispatch.CALLS.clear()


def test_the_guard_catches_every_kind_of_read():
    t = torch.ones(())
    with no_host_reads():
        for read in (
            lambda: t.item(),
            lambda: bool(t),
            lambda: int(t),
            lambda: float(t),
            lambda: [0, 1][t.long()],
            lambda: t.tolist(),
        ):
            with pytest.raises(HostRead):
                read()


def _calls():
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(H, 2 * L + 1, generator=gen, **F64)
    index = torch.randint(0, 5, (B, L, L), generator=gen)
    yield "plain", {}
    yield "toeplitz B and C", dict(bias=Toeplitz(table), gate=Toeplitz(table.flip(1)))
    yield "relation B, checked", dict(bias=Relation(torch.randn(H, 5, **F64), index, True))
    yield "dense bias", dict(bias=torch.randn(B, H, L, L, generator=gen, **F64))
    yield (
        "causal + padding",
        dict(is_causal=True, key_padding_mask=torch.arange(L) >= torch.tensor([[L], [L - 2]])),
    )
    yield "bool mask", dict(attn_mask=torch.rand(L, L, generator=gen) > 0.3)
    yield "float mask", dict(attn_mask=torch.randn(L, L, generator=gen, **F64))
    yield "dropout", dict(dropout_p=0.25, dropout_seed=torch.tensor(7))
    ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2], [3, 1, 3, 1, 1, 2, 2]])
    yield "documents + causal", dict(document_ids=ids, is_causal=True)
    log_forget = torch.nn.functional.logsigmoid(torch.randn(B, H, L, generator=gen, **F64))
    yield "decay + documents", dict(bias=Decay(log_forget), document_ids=ids[:1])


CASES = list(_calls())


# The CPU backends but cpp (it never runs on an accelerator), and Triton under its interpreter.
BACKENDS = [b for b in native_backends("cpu") if b != "cpp"] + ["triton"]


@pytest.mark.parametrize(
    ("backend", "case", "norm"),
    itertools.product(
        BACKENDS,
        range(len(CASES)),
        ("softmax", "l2", "relu2"),  # not "exp": its overflow check must read (documented)
    ),
)
def test_no_backend_reads_a_value_forward_or_backward(backend, case, norm):
    label, call = CASES[case]
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, H, L, D, generator=gen, **F64, requires_grad=True) for _ in "qkv")
    try:
        attention(q, k, v, **call, normalization=norm, backend=backend)
    except ValueError:
        pytest.skip(f"{backend} does not take {label} with {norm}")
    expected = attention(q, k, v, **call, normalization=norm, backend=backend)
    upstream = torch.randn_like(expected)
    expected_grads = torch.autograd.grad(expected, (q, k, v), upstream)
    with no_host_reads():
        out = attention(q, k, v, **call, normalization=norm, backend=backend)
        grads = torch.autograd.grad(out, (q, k, v), upstream)
    torch.testing.assert_close(out, expected)
    for grad, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, want)


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "sdpa"])  # (SDPA: no gate)
def test_a_gate_at_a_tensor_start_reads_no_value_forward_or_backward(backend):
    """A static KV cache's queries start at a tensor (its length, under torch.compile): the
    gate's table shifted to their offsets is built and used without reading it."""
    import urpe

    gate = urpe.ToeplitzGate(H, 3, init="normal").double()
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(B, H, 4, D, generator=gen, **F64)
    k, v = (torch.randn(B, H, L, D, generator=gen, **F64) for _ in "kv")
    positions = urpe.Positions.contiguous(4, L, torch.tensor(2), 0)  # queries at 2..5
    exact = urpe.Positions(positions.query, positions.key)
    want = attention(q, k, v, gate=gate(exact), backend="reference")
    (want_grad,) = torch.autograd.grad(want.square().sum(), gate.table)
    with no_host_reads():
        out = attention(q, k, v, gate=gate(positions), backend=backend)
        (grad,) = torch.autograd.grad(out.square().sum(), gate.table)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(grad, want_grad)


# ---------------------------------------------------------------------------------------------
# On a GPU (make test-gpu): the real thing, checked by CUDA itself.

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
@pytest.mark.parametrize("backend", ["auto", "triton", "blockwise", "sdpa", "reference"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_no_synchronisation_on_cuda_forward_or_backward(backend, case):
    label, call = CASES[case]
    call = {
        k: (v.cuda() if isinstance(v, torch.Tensor) else _term_to(v, "cuda"))
        for k, v in call.items()
    }
    q, k, v = (torch.randn(B, H, L, D, device="cuda", requires_grad=True) for _ in "qkv")
    try:
        attention(q, k, v, **call, backend=backend)  # warm up: compile, autotune, plans
    except ValueError:
        pytest.skip(f"{backend} does not take {label}")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = attention(q, k, v, **call, backend=backend)
        torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _term_to(term, device):
    if isinstance(term, Toeplitz):
        return Toeplitz(term.table.to(device))
    if isinstance(term, Relation):
        return Relation(term.table.to(device), term.index.to(device), term.in_range)
    if isinstance(term, Decay):
        return Decay(term.log_forget.to(device))
    return term


@cuda
def test_a_decode_step_of_a_gated_hf_model_is_captured_in_a_cuda_graph():
    transformers = pytest.importorskip("transformers")
    import urpe.hf

    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = transformers.LlamaForCausalLM(config).cuda().eval()
    model.set_attn_implementation("sdpa")
    urpe.hf.add_urpe(model)
    cache = transformers.StaticCache(config=config, max_cache_len=32)
    ids = torch.randint(0, 64, (1, 8), device="cuda")
    token = torch.zeros(1, 1, dtype=torch.long, device="cuda")
    position = torch.tensor([8], device="cuda")
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
        for _ in range(2):  # warm up on a side stream, as CUDA graphs require
            model(token, past_key_values=cache, cache_position=position, use_cache=True)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = model(token, past_key_values=cache, cache_position=position).logits
        graph.replay()
        torch.cuda.synchronize()
    assert torch.isfinite(logits).all()


def test_a_gated_hf_decode_step_with_a_static_cache_compiles_as_one_graph():
    """transformers' own fast path (a static cache, torch.compile): one graph, so no value is
    read on the host anywhere in a decoding step (Dynamo breaks the graph at every read)."""
    transformers = pytest.importorskip("transformers")
    import urpe.hf

    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    model.set_attn_implementation("sdpa")
    urpe.hf.add_urpe(model)
    prompt = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(0))
    position, token = torch.tensor([5]), torch.tensor([[7]])

    def decode_step(forward):
        cache = transformers.StaticCache(config=config, max_cache_len=16)
        model(prompt, past_key_values=cache, use_cache=True)
        return forward(token, past_key_values=cache, cache_position=position).logits

    with torch.no_grad():
        for name, table in model.named_parameters():
            if "urpe" in name:
                table.uniform_(0.5, 1.5)  # a gate that changes the result
        eager = decode_step(model.forward)
        compiled = decode_step(torch.compile(model.forward, fullgraph=True, backend="eager"))
    torch.testing.assert_close(compiled, eager)
