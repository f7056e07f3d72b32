"""The "fox" encoding: Forgetting Transformer forget gates (Lin et al., ICLR 2025).

Checked against a direct transcription of the paper's Eq. 4-6 (a double loop summing log f_t
between key and query, written into a dense bias), forward and gradients; and as a model:
from TransformerConfig and the CLI, training on a synthetic task, on packed documents.
"""

import math

import pytest
import torch
import torch.nn.functional as F

import urpe
from urpe.encodings import POSITION_REGISTRY, EncodingSettings, ForgetGate

from .tiny import tiny_config

E, H = 8, 2

pytestmark = pytest.mark.usefixtures("one_thread")


def fox_attention(position="fox", gate=None, dim=E):
    settings = EncodingSettings(num_heads=H, head_dim=dim // H, dim=dim, max_length=8)
    gate = urpe.encodings.GATE_REGISTRY[gate].build(settings) if gate else None
    module = POSITION_REGISTRY[position].build(settings)
    mha = urpe.MultiheadAttention(dim, H, position=module, gate=gate, backend="reference")
    mha = mha.double()
    with torch.no_grad():  # forget gates well away from 1, so the decay matters
        module.proj.weight.normal_(0, 0.5)
        module.proj.bias.uniform_(0.0, 2.0)
        if gate is not None:
            gate.table.add_(torch.randn_like(gate.table) * 0.3)
    return mha


def paper_bias(x, proj):
    """FoX, Eq. 4-6, written out: f_t = sigmoid(w_h . x_t + b_h) per head, and
    D_ij = sum_{t=j+1..i} log f_t for j <= i (-inf above the diagonal, the causal mask)."""
    b, length, _ = x.shape
    heads = proj.weight.shape[0]
    bias = torch.full((b, heads, length, length), -math.inf, dtype=x.dtype)
    for n in range(b):
        for h in range(heads):
            log_f = [
                math.log(torch.sigmoid(proj.weight[h] @ x[n, t] + proj.bias[h]).item())
                for t in range(length)
            ]  # floats: no autograd here, see `paper_bias_differentiable`
            for i in range(length):
                for j in range(i + 1):
                    bias[n, h, i, j] = sum(log_f[j + 1 : i + 1])
    return bias


def paper_bias_differentiable(x, proj):
    """The same double loop on tensors, so gradients flow to w and b."""
    log_f = torch.log(torch.sigmoid(x @ proj.weight.T + proj.bias))  # (B, L, H)
    length = x.shape[1]
    rows = []
    for i in range(length):
        row = [log_f[:, j + 1 : i + 1].sum(1) for j in range(i + 1)]  # each (B, H)
        row += [torch.full_like(log_f[:, 0], -math.inf)] * (length - i - 1)
        rows.append(torch.stack(row, -1))  # (B, H, L)
    return torch.stack(rows, -2)  # (B, H, L, L)


def by_hand(mha, x, bias, gate=None):
    """Multi-head attention with a given dense bias (what mha should compute)."""

    def heads(t):
        return t.view(*x.shape[:2], H, -1).transpose(1, 2)

    q, k, v = heads(mha.q_proj(x)), heads(mha.k_proj(x)), heads(mha.v_proj(x))
    out = urpe.attention(q, k, v, bias=bias, gate=gate, backend="reference")
    return mha.out_proj(out.transpose(1, 2).reshape(x.shape))


def test_bias_equals_the_papers_formula():
    torch.manual_seed(0)
    mha = fox_attention()
    x = torch.randn(2, 6, E, dtype=torch.float64)
    with torch.no_grad():
        want = paper_bias(x, mha.position.proj)
    log_f = mha.position.key_state(x)  # (B, H, L)
    assert log_f.shape == (2, H, 6) and (log_f <= 0).all()
    with torch.no_grad():
        torch.testing.assert_close(mha(x, is_causal=True), by_hand(mha, x, want))


def test_gradients_reach_w_and_b_as_through_the_dense_formula():
    torch.manual_seed(1)
    mha = fox_attention(gate="toeplitz")
    x = torch.randn(2, 5, E, dtype=torch.float64)
    proj = mha.position.proj
    gate = mha.gate(urpe.Positions.sequence(5))
    mha(x, is_causal=True).square().sum().backward()
    got = [p.grad.clone() for p in (proj.weight, proj.bias)]
    assert all(g.abs().sum() > 0 for g in got)
    mha.zero_grad()
    by_hand(mha, x, paper_bias_differentiable(x, proj), gate).square().sum().backward()
    for g, p in zip(got, (proj.weight, proj.bias), strict=True):
        torch.testing.assert_close(g, p.grad)


def test_forget_gates_start_near_one():
    gate = ForgetGate(E, H)
    f = torch.sigmoid(gate.proj(torch.randn(100, E)))
    assert f.min() > 0.98 and f.max() < 1  # sigmoid(5) = 0.9933, w ~ N(0, 0.02)
    assert ForgetGate(E, H, init_bias=0.0).proj.bias.abs().max() == 0  # FoX's own default


def test_fox_from_config_and_cli():
    config = urpe.TransformerConfig(vocab_size=5, position={"name": "fox", "init_bias": 2.0})
    model = urpe.TransformerDecoder(config)
    assert isinstance(model.layers[0].mixer.position, ForgetGate)
    assert (model.layers[0].mixer.position.proj.bias == 2.0).all()
    from urpe.experiments.model_choices import _positions

    assert "fox" in _positions()  # --position fox in every reproduction


def test_a_tiny_fox_model_trains():
    torch.manual_seed(0)
    config = tiny_config(
        vocab_size=8, ffn_dim=None, max_len=16, position="fox", gate="toeplitz", norm_first=True
    )
    model = urpe.TransformerDecoder(config)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    start = torch.randint(0, 8, (16, 1))
    tokens = (start + torch.arange(12)) % 8  # count upwards: the next token is the last + 1
    losses = []
    for _ in range(30):
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.3 * losses[0]
    assert model.layers[0].mixer.position.proj.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("gate", [None, "toeplitz"])
def test_fox_on_packed_documents_equals_each_alone(gate):
    torch.manual_seed(2)
    config = urpe.TransformerConfig(
        vocab_size=7, max_len=8, num_layers=2, dim=E, num_heads=H, position="fox", gate=gate
    )
    model = urpe.TransformerDecoder(config).double().eval()
    with torch.no_grad():
        for layer in model.layers:
            layer.mixer.position.proj.bias.fill_(0.5)  # strong forgetting
    ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2]])
    tokens = torch.randint(0, 7, ids.shape)
    packed = model(tokens, document_ids=ids)
    for start, end in ((0, 3), (3, 7), (7, 9)):
        torch.testing.assert_close(packed[:, start:end], model(tokens[:, start:end]))


def test_fox_with_memory_decodes_the_same_with_and_without_a_cache():
    """The log f of memory and cached keys travel with them (KVCache.key_state)."""
    from urpe.models.lm import IncrementalState, LanguageModel

    torch.manual_seed(3)
    config = urpe.TransformerConfig(
        vocab_size=7, num_layers=2, dim=E, num_heads=H, position="fox", gate="toeplitz"
    )
    model = LanguageModel(config, segment_length=4, memory_length=4).double().eval()
    tokens = torch.randint(0, 7, (2, 11))
    with torch.no_grad():
        cached, plain = IncrementalState(model), IncrementalState(model, use_cache=False)
        torch.testing.assert_close(cached.feed(tokens), plain.feed(tokens))


def test_log_sigmoid_is_torchs_logsigmoid():
    """The gates' log f (-softplus(-x), which opens no parallel region on the CPU) has
    F.logsigmoid's values and gradient in float32 and float64, far into both tails (below
    x = -20, softplus's linear branch: off by e^x, relative 2e-9 at most)."""
    from urpe.encodings.forgetting import log_sigmoid

    for dtype in (torch.float32, torch.float64):
        x = torch.linspace(-60, 60, 2001, dtype=dtype).requires_grad_()
        got, want = log_sigmoid(x), F.logsigmoid(x)
        tight = dict(atol=1e-7, rtol=1e-6) if dtype == torch.float32 else dict(atol=0, rtol=3e-9)
        torch.testing.assert_close(got, want, **tight)
        (grad_got,) = torch.autograd.grad(got.sum(), x)
        (grad_want,) = torch.autograd.grad(want.sum(), x)
        torch.testing.assert_close(grad_got, grad_want, **tight)


def test_gates_call_their_projection_where_something_hooks_or_replaces_it():
    """The gates compute x W^T + b directly (a decoding step's module call costs as much as the
    product), unless a hook watches the projection, its forward was replaced, or it is not a
    plain nn.Linear: then the module is called, as before."""
    gate = ForgetGate(E, H)
    x = torch.randn(2, 3, E)
    want = F.logsigmoid(gate.proj(x)).transpose(-1, -2)  # (B, H, L)
    assert torch.equal(gate.key_state(x), want)
    seen = []
    handle = gate.proj.register_forward_hook(lambda module, args, out: seen.append(out))
    gate.key_state(x)
    handle.remove()
    with torch.nn.modules.module.register_module_forward_hook(lambda m, a, o: seen.append(o)):
        gate.key_state(x)
    gate.proj.forward = lambda t: seen.append(t) or torch.zeros(*t.shape[:-1], H)
    zero = gate.key_state(x)
    del gate.proj.forward
    assert len(seen) == 3 and torch.equal(zero, F.logsigmoid(torch.zeros(2, H, 3)))
    gate.proj = torch.nn.Sequential(gate.proj)  # a wrapper (PEFT's, say) is called
    assert torch.equal(gate.key_state(x), want)
