"""The attention context: built once per forward pass, terms computed once per module or tie,
past keys as one type, and names from the registries (mixers, encoding options, backends)."""

from __future__ import annotations

import pytest
import torch

import urpe
from urpe.encodings import (
    POSITION_REGISTRY,
    EncodingSpec,
    RelativeEncoding,
    register_position,
    registered,
)
from urpe.graph import GraphormerConfig
from urpe.nn import MIXER_REGISTRY, AttentionContext, KVCache, register_mixer

F64 = dict(dtype=torch.float64)


def _config(**changes):
    values = dict(vocab_size=11, max_len=12, num_layers=3, dim=16, num_heads=2)
    return urpe.TransformerConfig(**{**values, **changes})


def _count_calls(module: torch.nn.Module) -> list:
    calls = []
    module.register_forward_hook(lambda *_: calls.append(1))
    return calls


@pytest.mark.parametrize("share", [True, False])
def test_fire_mlp_runs_once_per_forward_when_layers_share_it(share):
    model = urpe.TransformerEncoder(_config(position="fire", gate="toeplitz", share_position=share))
    counts = [_count_calls(layer.mixer.position.mlp) for layer in model.layers]
    model(torch.randint(0, 11, (2, 7)))
    assert sum(map(len, counts)) == (1 if share else 3)


def test_a_shared_gate_is_looked_up_once_per_forward(monkeypatch):
    model = urpe.TransformerDecoder(_config(position="rpe", gate="toeplitz"))
    calls = []
    original = urpe.ToeplitzGate.forward

    def counting(self, positions):
        calls.append(self)
        return original(self, positions)

    monkeypatch.setattr(urpe.ToeplitzGate, "forward", counting)
    model(torch.randint(0, 11, (1, 5)))
    assert len(calls) == 1
    cache = model.new_cache()
    model(torch.randint(0, 11, (1, 3)), cache=cache)
    model(torch.randint(0, 11, (1, 2)), cache=cache)
    assert len(calls) == 3  # once per forward pass, not per layer


def test_shared_terms_give_the_same_result_and_gradients_as_per_layer_terms():
    torch.manual_seed(0)
    model = urpe.TransformerEncoder(_config(position="fire", gate="toeplitz")).double()
    tokens = torch.randint(0, 11, (2, 7))
    out = model(tokens)
    grads = torch.autograd.grad(out.square().sum(), list(model.parameters()))
    # The same model with the memo defeated: every layer computes its own (equal) term.
    for layer in model.layers:
        layer.mixer.position.term_key = layer.mixer.gate.term_key = None
    again = model(tokens)
    torch.testing.assert_close(again, out)
    for g, w in zip(
        torch.autograd.grad(again.square().sum(), list(model.parameters())), grads, strict=True
    ):
        torch.testing.assert_close(g, w)


def test_positions_are_shape_checked_once_per_forward(monkeypatch):
    model = urpe.TransformerDecoder(_config(position="rpe"))
    checks = []
    original = urpe.Positions.check_shape

    def counting(self, *args, **kwargs):
        checks.append(args)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(urpe.Positions, "check_shape", counting)
    model(torch.randint(0, 11, (2, 6)), positions=urpe.Positions.sequence(6, start=3))
    assert len(checks) == 1


def test_a_context_equals_the_per_call_keywords():
    mha = urpe.MultiheadAttention(
        8, 2, position=urpe.RelativeBias(2, 4), gate=urpe.ToeplitzGate(2, 4)
    ).double()
    x = torch.randn(2, 5, 8, **F64)
    pad = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    positions = urpe.Positions.from_padding(pad)
    context = AttentionContext(positions=positions, key_padding_mask=pad, is_causal=True)
    want = mha(x, key_padding_mask=pad, is_causal=True, positions=positions)
    torch.testing.assert_close(mha(x, context=context), want)
    with pytest.raises(TypeError, match="not both"):
        mha(x, context=context, is_causal=True)
    with pytest.raises(TypeError, match="unexpected keyword"):
        mha(x, causal=True)
    with pytest.raises(TypeError, match="urpe.Positions"):
        AttentionContext(positions=torch.arange(5))


def test_memory_is_past_keys_from_memory():
    """`memory=` and `past=KVCache.from_memory(...)` are the same keys: one past-keys type."""
    mha = urpe.MultiheadAttention(8, 2, position=urpe.RotaryEncoding(4)).double()
    x, memory = torch.randn(2, 3, 8, **F64), torch.randn(2, 4, 8, **F64)
    pad = torch.tensor([[True, False, False, False], [False] * 4])
    want = mha(
        x,
        memory=memory,
        key_padding_mask=torch.cat([pad, torch.zeros(2, 3).bool()], 1),
        is_causal=True,
    )
    past = KVCache.from_memory(mha, memory, padding=pad)
    assert past.length == 4 and past.padding.tolist() == pad.tolist()
    got = mha(x, context=AttentionContext(is_causal=True), past=past)
    torch.testing.assert_close(got, want)
    assert past.length == 7  # the segment's keys were appended


def test_decoder_memory_cache_matches_the_memory_forward():
    model = urpe.TransformerDecoder(_config(position="txl", gate="toeplitz", norm_first=True))
    model = model.double().eval()
    tokens = torch.randint(0, 11, (2, 9))
    _, inputs = model(tokens[:, :4], return_layer_inputs=True)
    want = model(tokens[:, 4:], memory=inputs)
    cache = model.memory_cache(inputs)
    torch.testing.assert_close(model(tokens[:, 4:], cache=cache), want)
    with pytest.raises(ValueError, match="attention in every layer"):
        urpe.TransformerDecoder(_config(mixers={1: "conv"})).double().memory_cache(inputs)


def test_mixers_refuse_past_keys_and_terms():
    mixer = urpe.SeparableConvMixer(8)
    x = torch.randn(1, 4, 8)
    with pytest.raises(NotImplementedError, match="incremental decoding"):
        mixer(x, past=KVCache())
    with pytest.raises(NotImplementedError, match="gate"):
        mixer(x, AttentionContext(gate=torch.ones(1, 1, 4, 4)))
    with pytest.raises(NotImplementedError, match="memory"):
        mixer(x, memory=x)
    causal = mixer(x, AttentionContext(is_causal=True))
    torch.testing.assert_close(causal, mixer(x, is_causal=True))
    # causal: the first output does not see later inputs
    changed = x.clone()
    changed[:, 3] += 1
    torch.testing.assert_close(mixer(changed, AttentionContext(is_causal=True))[:, 0], causal[:, 0])


class ShiftMixer(torch.nn.Module):
    """Each position takes its left neighbour's features (a toy mixer for the registry test)."""

    def __init__(self, dim):
        super().__init__()
        self.linear = torch.nn.Linear(dim, dim)

    def forward(self, x, context=None, *, past=None):
        return self.linear(torch.nn.functional.pad(x, (0, 0, 1, 0))[:, :-1])


def test_a_registered_mixer_is_a_config_choice_with_no_other_edit():
    with registered(register_mixer, "shift", ShiftMixer, lambda s: ShiftMixer(s.dim)):
        model = urpe.TransformerEncoder(_config(mixers={1: "shift"}))
        assert isinstance(model.layers[1].mixer, ShiftMixer)
        assert model(torch.randint(0, 11, (2, 5))).shape == (2, 5, 16)
    assert "shift" not in MIXER_REGISTRY
    with pytest.raises(ValueError, match="mixers\\[1\\] must be one of"):
        _config(mixers={1: "shift"})


def test_an_encoding_option_is_declared_beside_the_encoding():
    class WindowBias(RelativeEncoding):
        """-inf beyond a window of offsets: an encoding with an option of its own."""

        query_independent = True

        def __init__(self, window):
            super().__init__()
            self.window = window

        def bias(self, q, positions, scale):
            far = positions.offsets().abs()[:, None] > self.window  # (B or 1, 1, Lq, Lk)
            return torch.zeros(far.shape, dtype=q.dtype).masked_fill(far, float("-inf"))

    build = lambda s: WindowBias(s.window)  # noqa: E731
    with registered(register_position, "window", WindowBias, build, options={"window": 2}):
        default = urpe.TransformerEncoder(_config(position="window"))
        assert default.layers[0].mixer.position.window == 2
        wide = urpe.TransformerEncoder(_config(position={"name": "window", "window": 5}))
        assert wide.layers[2].mixer.position.window == 5
        again = urpe.TransformerConfig.from_dict(wide.config.to_dict())
        assert again.position == EncodingSpec("window", {"window": 5})
        with pytest.raises(ValueError, match="position encoding 'rpe' has no option 'window'"):
            _config(position={"name": "rpe", "window": 5})
    assert "window" not in POSITION_REGISTRY


def test_every_module_honours_backend():
    x = torch.randn(1, 4, 8)
    for position in (urpe.ShawRelative(4, 3), urpe.RelativeBias(2, 3), urpe.NoPosition()):
        with pytest.raises(ValueError, match="backend must be 'auto' or one of"):
            urpe.MultiheadAttention(8, 2, position=position, backend="no-such")(x)
    shaw = urpe.MultiheadAttention(8, 2, position=urpe.ShawRelative(4, 3), backend="blockwise")
    with pytest.raises(ValueError, match="reference kernel only"):
        shaw(x)
    shaw.backend = "reference"
    reference = shaw(x)
    shaw.backend = "auto"
    torch.testing.assert_close(shaw(x), reference)
    with pytest.raises(ValueError, match="backend"):
        GraphormerConfig(backend="no-such")
