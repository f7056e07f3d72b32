"""A FoX decoding step in one call (`urpe_cpp::forget_step`, forget_step.cpp): log f =
log_sigmoid(x W^T + b) of a token, added in float64 to the sums a growing cache keeps. The same
values as the Python step (the projection's sums in another order: to rounding; log f rounded to
the model's dtype as F.linear and softplus round it), nothing written but the two slots of the
new sum, anything it cannot lay out refused without a change, and a model that generates with it
gives what the Python step gives."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

import urpe.hf.forget_history as forget_history
from tests.hf_families import VOCAB
from tests.test_hf_decay import fox_model
from urpe.encodings.forgetting import ForgetGate, log_sigmoid
from urpe.kernels.cpp import unavailable
from urpe.kernels.cpp.ops import forget_step

pytestmark = pytest.mark.skipif(unavailable() is not None, reason="no C++ kernel")

HALF = (torch.bfloat16, torch.float16)


def _inputs(batch, heads, dim, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 1, dim, generator=g).to(dtype)
    weight = (torch.randn(heads, dim, generator=g) * dim**-0.5 * 2).to(dtype)
    bias = (torch.randn(heads, generator=g) * 3).to(dtype)
    sums = torch.randn(batch, heads, 12, generator=g, dtype=torch.float64)
    return x, weight, bias, sums


def _python_rows(x, weight, bias):
    rows = log_sigmoid(F.linear(x, weight, bias))  # (B, 1, H), what record_call computes
    return rows.float() if rows.dtype in HALF else rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, *HALF])
@pytest.mark.parametrize("batch,heads,dim", [(1, 8, 256), (4, 8, 256), (3, 5, 37), (1, 1, 1)])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("length", [0, 4])
def test_a_step_adds_what_the_python_step_adds(dtype, batch, heads, dim, with_bias, length):
    x, weight, bias, sums = _inputs(batch, heads, dim, dtype)
    bias = bias if with_bias else None
    before = sums.clone()
    rows = forget_step()(x, weight, bias, sums, length)
    want = _python_rows(x, weight, bias)
    assert rows.shape == (batch, 1, heads) and rows.dtype == want.dtype
    tolerance = {torch.float32: 1e-6, torch.float64: 1e-14}.get(dtype, 0.0)
    torch.testing.assert_close(rows, want, rtol=tolerance, atol=tolerance)
    previous = before[..., 0] if length else torch.zeros_like(before[..., 0])
    new_sum = previous + rows[:, 0].double()  # (B, H), the float64 add of the Python step
    assert torch.equal(sums[..., 0], new_sum) and torch.equal(sums[..., length + 1], new_sum)
    untouched = [s for s in range(sums.shape[-1]) if s not in (0, length + 1)]
    assert torch.equal(sums[..., untouched], before[..., untouched])


def test_large_gate_projections_match_to_float32_rounding():
    x, weight, bias, sums = _inputs(2, 32, 4096, torch.float32)
    rows = forget_step()(x, weight, bias, sums, 3)
    torch.testing.assert_close(rows, _python_rows(x, weight, bias), rtol=1e-5, atol=1e-5)


def _refused_cases():
    x, weight, bias, _ = _inputs(2, 4, 16, torch.float32)
    yield "weight transposed", (x, weight.T.contiguous().T, bias)
    yield "x strided", (torch.randn(2, 1, 32)[..., ::2], weight, bias)
    yield "two tokens", (torch.randn(2, 2, 16), weight, bias)
    yield "mixed dtypes", (x.double(), weight, bias)
    yield "bias dtype", (x, weight, bias.double())
    yield "bias strided", (x, weight, torch.randn(8)[::2])
    yield "integers", (x.long(), weight.long(), bias.long())
    yield "width", (torch.randn(2, 1, 15), weight, bias)


@pytest.mark.parametrize("case", list(_refused_cases()), ids=lambda c: c[0])
def test_what_it_cannot_lay_out_is_refused_without_a_change(case):
    _, (x, weight, bias) = case
    sums = torch.randn(2, 4, 12, dtype=torch.float64)
    before = sums.clone()
    assert forget_step()(x, weight, bias, sums, 3) is None
    assert torch.equal(sums, before)


def test_sums_without_room_are_an_error():
    x, weight, bias, sums = _inputs(2, 8, 16, torch.float32)
    with pytest.raises(RuntimeError, match="no room"):
        forget_step()(x, weight, bias, sums, sums.shape[-1] - 1)


def _generate(model, ids, **options):
    return model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, min_new_tokens=12,
        do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True,
        **options,
    )  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_generating_with_the_fused_step_gives_the_python_step_s_tokens(dtype, monkeypatch):
    """Greedy generation, batch 2, a growing cache: every decoding step of every layer takes the
    fused call, and tokens and logits are those of the Python step."""
    model = fox_model("llama", dtype=dtype)
    ids = torch.randint(2, VOCAB, (2, 6), generator=torch.Generator().manual_seed(5))
    calls = []
    entry = forget_step()
    monkeypatch.setattr(
        forget_history, "forget_step", lambda: lambda *a: calls.append(1) or entry(*a)
    )
    fused = _generate(model, ids)
    layers = model.config.num_hidden_layers
    assert len(calls) == 11 * layers  # every step after the prompt's, in every layer
    monkeypatch.setattr(forget_history, "forget_step", lambda: None)
    python = _generate(model, ids)
    assert torch.equal(fused.sequences, python.sequences)
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else {}
    torch.testing.assert_close(torch.stack(fused.logits), torch.stack(python.logits), **tolerance)


def test_a_step_recording_gradients_takes_the_python_step(monkeypatch):
    """With gradients the sums are kept out of place for autograd: the fused call (which writes
    in place and records nothing) is never made."""
    model = fox_model("llama")
    ids = torch.randint(2, VOCAB, (1, 5), generator=torch.Generator().manual_seed(6))
    monkeypatch.setattr(forget_history, "forget_step", lambda: pytest.fail("fused with grad"))
    cache = DynamicCache(config=model.config)
    model(ids[:, :4], past_key_values=cache, use_cache=True)
    logits = model(ids[:, 4:], past_key_values=cache, use_cache=True).logits
    logits.sum().backward()
    assert model.model.layers[0].self_attn.urpe_forget.proj.weight.grad is not None


class _DoubledGates(ForgetGate):
    """Gates of its own (log f doubled): a decoding step must compute them as the class does."""

    def log_forget_rows(self, x):
        return 2 * super().log_forget_rows(x)


def _halve(module, args, output):
    return output / 2


@pytest.mark.parametrize("change", ["subclass", "hooked projection"])
def test_gates_computed_another_way_are_never_fused(change, monkeypatch):
    """A subclass's own gates, or a projection a hook watches: every decoding step computes
    log f as the module does (the Python step), so cached generation equals uncached."""
    model = fox_model("llama", dtype=torch.float32)
    for module in model.modules():
        forget = module._modules.get("urpe_forget")
        if forget is None:
            continue
        if change == "subclass":
            forget.__class__ = _DoubledGates
        else:
            forget.proj.register_forward_hook(_halve)
    monkeypatch.setattr(forget_history, "forget_step", lambda: pytest.fail("fused"))
    ids = torch.randint(2, VOCAB, (2, 6), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        cached = _generate(model, ids)
        uncached = _generate(model, ids, use_cache=False)
    assert torch.equal(cached.sequences, uncached.sequences)
    torch.testing.assert_close(torch.stack(cached.logits), torch.stack(uncached.logits))


def test_a_step_off_the_cpu_never_asks_for_the_cpu_library(monkeypatch):
    """On another device (here "meta") the step is the Python one, and the C++ library is not
    even looked up (looking it up may build it: a GPU user's generate must not)."""
    monkeypatch.setattr(forget_history, "forget_step", lambda: pytest.fail("looked up"))
    kept = forget_history.Cumulative(torch.zeros(2, 4, 3, dtype=torch.float64, device="meta"))
    x = torch.randn(2, 1, 16, device="meta")
    assert kept.fused_step(x, torch.randn(4, 16, device="meta"), None) is None
    assert kept.length == 3
