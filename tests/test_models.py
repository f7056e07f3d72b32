"""Encoder and decoder behaviour: cached decoding, causality, padding, length, sharing, mixers."""

import pytest
import torch

import urpe
from urpe.models import POSITIONS

VARIANTS = {
    **{p: dict(position=p) for p in POSITIONS},
    "urpe": dict(position="rpe", gate="toeplitz"),
    "urpe-t5": dict(position="t5", gate="t5"),
    "exp": dict(position="rpe", normalization="exp"),
    "l2": dict(position="rpe", normalization="l2"),
    "relu2": dict(position="rpe", normalization="relu2"),
    "ape": dict(absolute="learned"),
    "sinusoidal": dict(absolute="sinusoidal"),
    "markers": dict(position="rpe", markers=True),
    "per-layer": dict(position="rpe", gate="toeplitz", share_position=False),
    "pre-ln": dict(position="alibi", norm_first=True),
}


def build(kind, max_len=16, **overrides):
    config = urpe.TransformerConfig(
        vocab_size=11, max_len=max_len, num_layers=2, dim=16, num_heads=2, **overrides
    )
    model = kind(config).double().eval()
    with torch.no_grad():  # move every gate away from ones so it matters
        for name, p in model.named_parameters():
            if "gate" in name:
                p.add_(torch.randn_like(p) * 0.3)
    return model


@pytest.mark.parametrize("name", VARIANTS)
def test_cached_decoding_equals_full_forward(name):
    model = build(urpe.TransformerDecoder, **VARIANTS[name])
    tokens = torch.randint(0, 11, (2, 9))
    full = model(tokens)
    cache = model.new_cache()
    chunks = [model(tokens[:, a:b], cache=cache) for a, b in [(0, 4), (4, 5), (5, 6), (6, 9)]]
    torch.testing.assert_close(torch.cat(chunks, 1), full, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", [*VARIANTS, "bilinear", "conv"])
def test_decoder_never_sees_the_future(name):
    overrides = {"bilinear": dict(mixers={0: "bilinear"}), "conv": dict(mixers={1: "conv"})}
    model = build(urpe.TransformerDecoder, **overrides.get(name, VARIANTS.get(name, {})))
    tokens = torch.randint(0, 11, (2, 10))
    changed = tokens.clone()
    changed[:, 6:] = (changed[:, 6:] + 1) % 11
    a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :6], b[:, :6], rtol=1e-12, atol=1e-12)
    assert not torch.allclose(a[:, 6:], b[:, 6:])


@pytest.mark.parametrize("name", [*VARIANTS, "bilinear", "conv"])
@pytest.mark.parametrize("kind", [urpe.TransformerEncoder, urpe.TransformerDecoder])
def test_appended_padding_changes_nothing(name, kind):
    overrides = {"bilinear": dict(mixers={0: "bilinear"}), "conv": dict(mixers={1: "conv"})}
    model = build(kind, **overrides.get(name, VARIANTS.get(name, {})))
    short = torch.randint(0, 11, (2, 7))
    lengths = [7, 5]
    padded = torch.cat([short, torch.randint(0, 11, (2, 4))], 1)
    mask = torch.arange(11)[None, :] >= torch.tensor(lengths)[:, None]  # (B, 11)
    out = model(padded, key_padding_mask=mask)
    for row, n in enumerate(lengths):
        alone = model(short[row : row + 1, :n])
        torch.testing.assert_close(out[row : row + 1, :n], alone, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", [n for n in VARIANTS if n not in ("ape",)])
def test_longer_than_max_len_works_for_relative_encodings(name):
    model = build(urpe.TransformerEncoder, max_len=8, **VARIANTS[name])
    out = model(torch.randint(0, 11, (1, 20)))
    assert out.shape == (1, 20, 16) and torch.isfinite(out).all()


def test_learned_absolute_refuses_longer_inputs():
    model = build(urpe.TransformerEncoder, max_len=8, absolute="learned")
    with pytest.raises(ValueError, match="max_len=8"):
        model(torch.randint(0, 11, (1, 9)))


def test_rpe_clips_offsets_beyond_max_len():
    model = build(urpe.TransformerEncoder, max_len=4, position="rpe")
    table = model.layers[0].mixer.position.table
    assert table.shape == (2, 7)  # offsets -3..3: the paper's unique mode, 2L-1 entries
    dense = urpe.Toeplitz(table).dense(10, 10)[0]
    assert torch.equal(dense[:, 0, 9], table[:, -1]) and torch.equal(dense[:, 9, 0], table[:, 0])


def test_sharing_position_and_gate_across_layers():
    shared = build(urpe.TransformerEncoder, position="rpe", gate="toeplitz")
    apart = build(urpe.TransformerEncoder, position="rpe", gate="toeplitz", share_position=False)
    layers = shared.layers
    assert layers[0].mixer.position is layers[1].mixer.position
    assert layers[0].mixer.gate is layers[1].mixer.gate
    assert apart.layers[0].mixer.gate is not apart.layers[1].mixer.gate
    n_shared = sum(p.numel() for p in shared.parameters())
    n_apart = sum(p.numel() for p in apart.parameters())
    assert n_apart - n_shared == 2 * (2 * 31)  # one more B and C, each (H=2) x (2*16-1)


def test_urpe_gradients_reach_b_and_c():
    model = build(urpe.TransformerEncoder, position="rpe", gate="toeplitz")
    model(torch.randint(0, 11, (2, 6))).square().sum().backward()
    mixer = model.layers[0].mixer
    assert mixer.position.table.grad.abs().sum() > 0 and mixer.gate.table.grad.abs().sum() > 0


def test_mixers_replace_attention_in_chosen_layers():
    model = build(urpe.TransformerEncoder, mixers={0: "bilinear", 1: "conv"})
    assert isinstance(model.layers[0].mixer, urpe.BilinearMixer)
    assert isinstance(model.layers[1].mixer, urpe.SeparableConvMixer)
    assert model(torch.randint(0, 11, (2, 9))).shape == (2, 9, 16)
    decoder = build(urpe.TransformerDecoder, mixers={0: "conv"})
    with pytest.raises(NotImplementedError, match="incremental decoding"):
        decoder(torch.randint(0, 11, (1, 3)), cache=decoder.new_cache())
    with pytest.raises(ValueError, match="max_len"):
        build(urpe.TransformerEncoder, max_len=8, mixers={0: "bilinear"})(torch.ones(1, 9).long())


def test_markers_are_part_of_the_model_and_stripped_from_outputs():
    model = build(urpe.TransformerEncoder, position="rpe", markers=True)
    assert model(torch.randint(0, 11, (3, 5))).shape == (3, 5, 16)
    assert {"markers.start", "markers.end"} <= dict(model.named_parameters()).keys()


def test_multihead_cross_attention_and_dropout():
    mha = urpe.MultiheadAttention(16, 4, kdim=6, vdim=5, dropout=0.5)
    x, mem = torch.randn(2, 3, 16), torch.randn(2, 7, 6)
    out = mha(x, mem, torch.randn(2, 7, 5), key_padding_mask=torch.zeros(2, 7, dtype=torch.bool))
    assert out.shape == (2, 3, 16)
    mha.eval()
    torch.testing.assert_close(mha(x, mem, mem[..., :5]), mha(x, mem, mem[..., :5]))
    with pytest.raises(ValueError, match="divisible"):
        urpe.MultiheadAttention(10, 4)


def test_kv_cache_keeps_padding():
    mha = urpe.MultiheadAttention(8, 2, position=urpe.RelativeBias(2, 8)).double().eval()
    x = torch.randn(1, 5, 8, dtype=torch.float64)
    pad = torch.tensor([[False, True, False, False, False]])
    full = mha(x, key_padding_mask=pad, is_causal=True)
    cache = urpe.KVCache()
    first = mha(x[:, :2], key_padding_mask=pad[:, :2], is_causal=True, cache=cache)
    rest = mha(x[:, 2:], is_causal=True, cache=cache)
    torch.testing.assert_close(torch.cat([first, rest], 1), full)
    assert cache.length == 5 and cache.padding.tolist() == pad.tolist()
