"""`urpe.attention` in the modes users run it in: mixed precision (autocast), forward-mode AD,
torch.compile without graph breaks, and inputs that broadcast (issue 39)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.autograd import forward_ad

import urpe
from urpe.kernels import BACKENDS, Decay, Toeplitz, attention, native_backends

F64 = dict(dtype=torch.float64)
CPU_BACKENDS = native_backends("cpu")


def _qkv(b=2, h=2, lq=5, lk=7, d=8, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, h, n, d, generator=gen, dtype=dtype) for n in (lq, lk, lk))


# ---------------------------------------------------------------------------------------------
# Mixed precision


@pytest.mark.parametrize("backend", ["auto", *CPU_BACKENDS])
def test_under_autocast_the_result_has_sdpas_dtype_on_every_backend(backend):
    """RoPE hands float32 queries and keys beside bfloat16 values to attention under autocast:
    SDPA casts all three; so does urpe.attention (a crash before, issue 39 item 6)."""
    q, k, v = _qkv()
    v = v.to(torch.bfloat16)
    call = dict(is_causal=True)
    if backend != "sdpa":
        call["gate"] = Toeplitz(torch.rand(2, 13) + 0.5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out = attention(q, k, v, **call, backend=backend)
    assert out.dtype == want.dtype == torch.bfloat16
    exact = attention(*(t.to(torch.bfloat16) for t in (q, k, v)), **call, backend="reference")
    torch.testing.assert_close(out, exact, rtol=2e-2, atol=2e-2)


def test_under_autocast_float64_stays_float64_as_in_sdpa():
    q, k, v = _qkv(dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert F.scaled_dot_product_attention(q, k, v).dtype == torch.float64
        assert attention(q, k, v, gate=Toeplitz(torch.ones(2, 13, **F64))).dtype == torch.float64


def test_a_prepared_call_follows_autocast_too():
    q, k, v = _qkv()
    gate = Toeplitz(torch.ones(2, 13))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        step = urpe.kernels.prepare(q, k, v, gate=gate)  # for what the kernels will see
        assert step(q, k, v, gate=gate).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="under autocast the dtype is autocast's"):
        step(q, k, v, gate=gate)  # float32 outside autocast: another kind


@pytest.mark.parametrize("position", ["rope", "rpe", "fox"])
def test_a_library_model_trains_under_autocast(position):
    config = urpe.TransformerConfig(
        vocab_size=20, num_layers=2, dim=16, num_heads=2, max_len=12, position=position,
        gate="toeplitz",
    )  # fmt: skip
    model = urpe.TransformerDecoder(config)
    tokens = torch.randint(0, 20, (2, 9))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(tokens)
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens.flatten())
    loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_the_reference_sums_a_half_precision_decay_in_float32():
    """The reference once summed a bfloat16 log_forget in bfloat16 (0.023 off the C++ kernel,
    which sums in float32): half precision is computed in float32 everywhere (item 5)."""
    q, k, v = _qkv(lq=64, lk=64, dtype=torch.bfloat16)
    log_forget = (-torch.rand(2, 2, 64) * 0.1).to(torch.bfloat16)
    exact = attention(
        *(t.double() for t in (q, k, v)), bias=Decay(log_forget.double()), backend="reference"
    )
    for backend in CPU_BACKENDS:
        if backend == "sdpa":
            continue
        out = attention(q, k, v, bias=Decay(log_forget), backend=backend)
        # bfloat16 rounding of the output only (2^-8 relative)
        torch.testing.assert_close(out.double(), exact, rtol=1e-2, atol=1e-2)
    dense = Decay(log_forget).dense(64, 64)
    assert dense.dtype == torch.float32
    torch.testing.assert_close(dense.double(), Decay(log_forget.double()).dense(64, 64))


# ---------------------------------------------------------------------------------------------
# Forward-mode AD


def _tangent_of(backend: str, q, k, v, dq, **call):
    with forward_ad.dual_level():
        out = attention(forward_ad.make_dual(q, dq), k, v, **call, backend=backend)
        return forward_ad.unpack_dual(out).tangent


def test_forward_mode_ad_gives_the_tangent_or_a_clear_refusal_on_every_backend():
    """Dual tensors through "auto" once came back with tangent None (silently): "auto" runs them
    on the reference, the other backends refuse by name (item 23)."""
    q, k, v = _qkv(dtype=torch.float64)
    dq = torch.randn_like(q)
    gate = Toeplitz(torch.rand(2, 13, **F64) + 0.5)
    want = torch.func.jvp(
        lambda q: attention(q, k, v, gate=gate, backend="reference"), (q,), (dq,)
    )[1]
    for backend in ("auto", "reference"):
        got = _tangent_of(backend, q, k, v, dq, gate=gate)
        torch.testing.assert_close(got, want)
    got = torch.func.jvp(lambda q: attention(q, k, v, gate=gate), (q,), (dq,))[1]
    torch.testing.assert_close(got, want)
    for backend in CPU_BACKENDS:
        if BACKENDS[backend].capabilities.forward_ad:
            continue
        with pytest.raises(ValueError, match="no forward-mode AD"):
            _tangent_of(backend, q, k, v, dq, is_causal=True)


# ---------------------------------------------------------------------------------------------
# Broadcast inputs


@pytest.mark.parametrize("normalization", ["softmax", "exp", "l2", "relu2"])
@pytest.mark.parametrize("lk", [7, 600])
def test_document_ids_broadcast_over_the_keys_on_every_backend(normalization, lk):
    """document_ids of last dim 1 ("broadcastable to (..., Lk)": one document for all keys)
    were read as Lk ids from a one-entry row by the C++ kernel (silently wrong), crashed
    elsewhere (item 21)."""
    q, k, v = _qkv(lq=3, lk=lk, dtype=torch.float64)
    k[1, 0, 2, 0] = float("nan")  # the non-finite rule's counting path too
    ids = torch.zeros(2, 1, dtype=torch.long)
    want = attention(q, k, v, normalization=normalization, backend="reference")
    for backend in CPU_BACKENDS:
        if normalization != "softmax" and backend == "sdpa":
            continue
        out = attention(q, k, v, document_ids=ids, normalization=normalization, backend=backend)
        torch.testing.assert_close(out, want, equal_nan=True)


# ---------------------------------------------------------------------------------------------
# torch.compile


@pytest.mark.parametrize("position", ["rpe", "fox", "rope"])
def test_a_library_models_training_forward_compiles_without_graph_breaks(position):
    config = urpe.TransformerConfig(
        vocab_size=20, num_layers=2, dim=16, num_heads=2, max_len=12, position=position,
        gate="toeplitz",
    )  # fmt: skip
    model = urpe.TransformerDecoder(config).train()
    tokens = torch.randint(0, 20, (2, 9))
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(tokens)
    assert explained.graph_break_count == 0, explained.break_reasons
