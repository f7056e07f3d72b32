"""torch.compile(fullgraph=True) and torch.func on the modules: no graph break, eager results.

`fullgraph=True` turns any graph break into an error. The default run compiles with the
"aot_eager" backend (Dynamo capture plus AOT autograd tracing, where graphs break) to keep the
suite fast; a slow test goes through Inductor end to end.
"""

import pytest
import torch
from torch.func import functional_call, grad

import urpe
from urpe.kernels import native_backends

F64 = dict(dtype=torch.float64)
# The blockwise and cpp backends run as torch.library custom ops (a fake implementation lets Dynamo
# trace through them); the other two are plain PyTorch ops.
BACKENDS = {
    "reference": dict(position="rpe", gate="toeplitz"),
    "sdpa": dict(position="rpe"),
    "blockwise": dict(position="rpe", gate="toeplitz"),
    "cpp": dict(position="rpe", gate="toeplitz"),
}
BACKENDS = {name: terms for name, terms in BACKENDS.items() if name in native_backends("cpu")}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def model(kind, backend, **overrides):
    config = urpe.TransformerConfig(
        vocab_size=11,
        max_len=16,
        num_layers=2,
        dim=16,
        num_heads=2,
        attention_backend=backend,
        **{**BACKENDS[backend], **overrides},
    )
    m = kind(config).double()  # float64: compiled and eager then agree to rounding
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "gate" in name:
                p.add_(torch.randn_like(p) * 0.3)
    return m


def assert_same_values_and_grads(module, compiled, *args, **kwargs):
    module.zero_grad()
    eager = module(*args, **kwargs)
    eager.square().sum().backward()
    want = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    module.zero_grad()
    got = compiled(*args, **kwargs)
    got.square().sum().backward()
    torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-6)
    for name, g in want.items():
        torch.testing.assert_close(
            dict(module.named_parameters())[name].grad, g, rtol=1e-4, atol=1e-6
        )


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_multihead_attention_compiles_fullgraph(backend):
    gate = urpe.ToeplitzGate(2, 4) if backend != "sdpa" else None
    mha = urpe.MultiheadAttention(
        16, 2, position=urpe.RelativeBias(2, 4), gate=gate, backend=backend
    ).double()
    compiled = torch.compile(mha, fullgraph=True, backend="aot_eager")
    x = torch.randn(2, 5, 16, **F64)
    pad = torch.tensor([[False] * 5, [True, True, False, False, False]])
    assert_same_values_and_grads(mha, compiled, x, key_padding_mask=pad, is_causal=True)
    memory = torch.randn(2, 3, 16, **F64)
    assert_same_values_and_grads(mha, compiled, x, memory=memory, is_causal=True)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_encoder_compiles_fullgraph(backend):
    encoder = model(urpe.TransformerEncoder, backend, markers=True)
    compiled = torch.compile(encoder, fullgraph=True, backend="aot_eager")
    tokens = torch.randint(0, 11, (2, 7))
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[1, :2] = True
    assert_same_values_and_grads(encoder, compiled, tokens, pad)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_decoder_compiles_fullgraph_with_positions(backend):
    decoder = model(urpe.TransformerDecoder, backend, position="fire", absolute="learned")
    compiled = torch.compile(decoder, fullgraph=True, backend="aot_eager")
    tokens = torch.randint(0, 11, (2, 6))
    assert_same_values_and_grads(decoder, compiled, tokens)
    pad = torch.tensor([[False] * 6, [True] * 2 + [False] * 4])
    positions = urpe.Positions.from_padding(pad)  # per row: the exact fallback terms
    assert_same_values_and_grads(decoder, compiled, tokens, pad, positions=positions)


@pytest.mark.slow  # Inductor's first compile alone takes ~50 s on 2 cores
def test_encoder_compiles_with_inductor():
    encoder = model(urpe.TransformerEncoder, "reference", norm_first=True).eval()
    compiled = torch.compile(encoder, fullgraph=True)
    tokens = torch.randint(0, 11, (2, 7))
    torch.testing.assert_close(compiled(tokens), encoder(tokens), rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_checks_stay_on_under_compile():
    # Data-dependent checks become device assertions inside the graph: still an error.
    encoder = model(urpe.TransformerEncoder, "reference")
    compiled = torch.compile(encoder, fullgraph=True, backend="aot_eager")
    compiled(torch.randint(0, 11, (1, 4)))
    with pytest.raises(RuntimeError, match="token ids must lie in"):
        compiled(torch.tensor([[1, 2, 11, 3]]))
    graph = model(
        urpe.TransformerEncoder, "reference", position="relation", gate="relation", num_relations=3
    )
    compiled = torch.compile(graph, fullgraph=True, backend="aot_eager")
    tokens = torch.randint(0, 11, (1, 4))
    compiled(tokens, positions=urpe.Positions.graph(torch.randint(0, 3, (1, 4, 4))))
    with pytest.raises(RuntimeError, match="positions.relation must hold"):
        compiled(tokens, positions=urpe.Positions.graph(torch.full((1, 4, 4), 3)))


@pytest.mark.parametrize("share_position", [True, False])
def test_functional_call_and_grad_on_the_encoder(share_position):
    encoder = model(
        urpe.TransformerEncoder, "reference", markers=True, share_position=share_position
    )
    tokens = torch.randint(0, 11, (2, 6))
    pad = torch.zeros(2, 6, dtype=torch.bool)
    pad[0, :2] = True
    params = {n: p.detach().clone() for n, p in encoder.named_parameters()}
    before = {n: p for n, p in encoder.named_parameters()}

    def loss(p):
        return functional_call(encoder, p, (tokens, pad)).square().sum()

    grads = grad(loss)(params)
    encoder(tokens, pad).square().sum().backward()
    for name, p in encoder.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-10, atol=1e-12)
    # The module is left as it was: the same Parameter objects, still tied across layers.
    assert all(p is before[n] for n, p in encoder.named_parameters())
    if share_position:
        layers = encoder.layers
        assert layers[0].mixer.position.table is layers[1].mixer.position.table
    # Substituted parameters are what the forward pass uses.
    zeroed = {**params, "embed.weight": torch.zeros_like(params["embed.weight"])}
    assert not torch.allclose(functional_call(encoder, zeroed, (tokens, pad)), encoder(tokens, pad))
