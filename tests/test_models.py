"""Encoder and decoder behaviour: cached decoding, causality, padding, length, sharing, mixers,
positions, memory, markers with any padding, precomputed terms, loading state dicts."""

import pytest
import torch

import urpe
from urpe.encodings import GATE_REGISTRY, POSITION_REGISTRY

from .naive import naive_attention

# Every registered encoding that works from sequence positions (the relation-indexed ones need a
# graph relation; they are tested in test_positions.py and below).
SEQUENCE_POSITIONS = [n for n, r in POSITION_REGISTRY.items() if not r.uses_relation]
SEQUENCE_GATES = [n for n, r in GATE_REGISTRY.items() if not r.uses_relation]
GATED = {f"{p}+{g}": dict(position=p, gate=g) for p in SEQUENCE_POSITIONS for g in SEQUENCE_GATES}
VARIANTS = {
    **{p: dict(position=p) for p in SEQUENCE_POSITIONS},
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
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "gate" in name:  # move every gate away from ones so it matters
                p.add_(torch.randn_like(p) * 0.3)
            if name.endswith("threshold"):  # FIRE: query positions matter from 2 on
                p.fill_(2.0)
    return model


@pytest.mark.parametrize("name", [*VARIANTS, *GATED])
def test_cached_decoding_equals_full_forward(name):
    model = build(urpe.TransformerDecoder, **{**VARIANTS, **GATED}[name])
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
    # Shared as tied parameters (not one module object: see builders.tied_copy).
    assert layers[0].mixer.position.table is layers[1].mixer.position.table
    assert layers[0].mixer.gate.table is layers[1].mixer.gate.table
    assert apart.layers[0].mixer.gate.table is not apart.layers[1].mixer.gate.table
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


# ------------------------------------------------------------------ positions, cache and memory
# Variants whose outputs depend on absolute positions too: they make the offset tests bite.
ABSOLUTE_TOO = {
    "fire": dict(position="fire"),
    "ape": dict(absolute="learned"),
    "sinusoidal": dict(absolute="sinusoidal", position="rope"),
}
EVERY_GATE = {f"fire+{g}": dict(position="fire", gate=g) for g in SEQUENCE_GATES}
OFFSET_VARIANTS = {**VARIANTS, **EVERY_GATE, **ABSOLUTE_TOO}
OFFSET_VARIANTS.pop("markers")  # markers wrap the first chunk only; tested separately


@pytest.mark.parametrize("name", OFFSET_VARIANTS)
def test_positions_offset_by_m_equal_a_prefix_hidden_in_the_cache(name):
    model = build(urpe.TransformerDecoder, **OFFSET_VARIANTS[name])
    m, tokens = 5, torch.randint(0, 11, (2, 6))
    # (a) the decoder saw an m-token prefix through its cache, all of it hidden by padding
    cache = model.new_cache()
    model(torch.randint(0, 11, (2, m)), key_padding_mask=torch.ones(2, m, dtype=bool), cache=cache)
    through_cache = model(tokens, cache=cache)
    # (b) no prefix at all, the tokens told that they sit at m..m+5
    offset = model(tokens, positions=urpe.Positions.sequence(6, start=m))
    torch.testing.assert_close(offset, through_cache, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", OFFSET_VARIANTS)
def test_cache_path_equals_explicit_per_row_positions(name):
    model = build(urpe.TransformerDecoder, **OFFSET_VARIANTS[name])
    prefix, tokens = torch.randint(0, 11, (2, 4)), torch.randint(0, 11, (2, 3))
    outs = []
    for positions in (
        None,
        urpe.Positions(torch.arange(4, 7).expand(2, 3), torch.arange(7).expand(2, 7)),
    ):
        cache = model.new_cache()
        model(prefix, cache=cache)
        outs.append(model(tokens, cache=cache, positions=positions))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-10, atol=1e-10)


MEMORY_VARIANTS = {**VARIANTS, **EVERY_GATE, **ABSOLUTE_TOO}


@pytest.mark.parametrize("name", MEMORY_VARIANTS)
def test_memory_equals_the_full_forward_on_memory_plus_segment(name):
    model = build(urpe.TransformerDecoder, **MEMORY_VARIANTS[name])
    m, tokens = 5, torch.randint(0, 11, (2, 9))
    full, inputs = model(tokens, return_layer_inputs=True)
    extra = 1 if model.markers is not None else 0  # [CLS] sits in front of the prefix
    memory = urpe.models.next_memory(None, [h[:, : m + extra] for h in inputs], size=m + extra)
    segment = model(tokens[:, m:], memory=memory)
    torch.testing.assert_close(segment, full[:, m:], rtol=1e-10, atol=1e-10)


def test_memory_rolls_over_segments_like_transformer_xl():
    # Three segments with memory = the previous layer inputs (unbounded here): exactly the full
    # forward, segment by segment; with a memory of 4 the first outputs still match.
    model = build(urpe.TransformerDecoder, position="rpe", gate="toeplitz", norm_first=True)
    tokens = torch.randint(0, 11, (2, 12))
    full = model(tokens)
    memory, outs = None, []
    for a in (0, 4, 8):
        logits, inputs = model(tokens[:, a : a + 4], memory=memory, return_layer_inputs=True)
        outs.append(logits)
        memory = urpe.models.next_memory(memory, inputs, size=12)
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-10, atol=1e-10)
    assert memory[0].shape == (2, 12, 16) and not memory[0].requires_grad


def test_memory_padding_and_errors():
    model = build(urpe.TransformerDecoder, position="rpe")
    tokens = torch.randint(0, 11, (1, 7))
    pad = torch.tensor([[True, False, False, False, False, False, False]])
    full, inputs = model(tokens, key_padding_mask=pad, return_layer_inputs=True)
    memory = [h[:, :3] for h in inputs]
    # A padding mask over memory + segment hides the padded memory key...
    got = model(tokens[:, 3:], key_padding_mask=pad, memory=memory)
    torch.testing.assert_close(got, full[:, 3:], rtol=1e-10, atol=1e-10)
    # ...one over the segment alone counts the memory as real: the padded key is seen.
    seen = model(tokens[:, 3:], key_padding_mask=pad[:, 3:], memory=memory)
    torch.testing.assert_close(seen, model(tokens[:, 3:], memory=memory))
    assert not torch.allclose(seen, got)
    with pytest.raises(ValueError, match="one \\(B, M, E\\) tensor per layer"):
        model(tokens, memory=memory[:1])
    with pytest.raises(ValueError, match="same shape"):
        model(tokens, memory=[memory[0], memory[1][:, :2]])
    with pytest.raises(ValueError, match="without a KVCache"):
        model.layers[0].mixer(inputs[0], memory=memory[0], cache=urpe.KVCache())
    with pytest.raises(ValueError, match="key_padding_mask"):
        model(tokens[:, 3:], key_padding_mask=torch.zeros(1, 5, dtype=bool), memory=memory)
    with pytest.raises(ValueError, match="KVCache"):
        model(tokens, memory=memory, cache=model.new_cache())


def test_cross_attention_refuses_a_cache():
    mha = urpe.MultiheadAttention(8, 2)
    with pytest.raises(ValueError, match="KVCache is for self-attention"):
        mha(torch.randn(1, 2, 8), torch.randn(1, 5, 8), cache=urpe.KVCache())


def test_cross_attention_aligns_rope_queries_with_the_bias():
    # Default cross-attention positions are urpe.attention's own: queries the last Lq keys.
    mha = urpe.MultiheadAttention(8, 2, position=urpe.RotaryEncoding(4)).double()
    x, context = (
        torch.randn(1, 2, 8, dtype=torch.float64),
        torch.randn(1, 5, 8, dtype=torch.float64),
    )
    explicit = urpe.Positions(torch.tensor([3, 4]), torch.arange(5))
    torch.testing.assert_close(mha(x, context), mha(x, context, positions=explicit))


# ------------------------------------------------------------------------- markers and padding
@pytest.mark.parametrize(
    "name",
    [
        n
        for n, v in VARIANTS.items()
        if not v.get("absolute")
        and POSITION_REGISTRY[v.get("position", "none")].cls.shift_invariant
    ],
)
def test_markers_outputs_do_not_depend_on_the_side_of_padding(name):
    overrides = VARIANTS[name]
    model = build(urpe.TransformerEncoder, **{**overrides, "markers": True})
    real = torch.randint(0, 11, (1, 5))
    alone = model(real)

    def padded(left, right):
        tokens = torch.cat([torch.zeros(1, left).long(), real, torch.zeros(1, right).long()], 1)
        mask = torch.ones_like(tokens, dtype=torch.bool)
        mask[:, left : left + 5] = False
        return model(tokens, key_padding_mask=mask)[:, left : left + 5]

    for left, right in ((0, 3), (3, 0), (2, 1), (0, 0)):
        torch.testing.assert_close(padded(left, right), alone, rtol=1e-10, atol=1e-10)


def test_markers_sit_around_the_real_tokens_for_any_padding():
    markers = urpe.models.MarkerTokens(1)
    with torch.no_grad():
        markers.start.fill_(-1.0)
        markers.end.fill_(-2.0)
    x = torch.arange(1.0, 5.0).view(1, 4, 1).repeat(4, 1, 1)  # tokens 1 2 3 4
    pad = torch.tensor([[1, 1, 0, 0], [0, 0, 1, 1], [1, 0, 0, 1], [1, 1, 1, 1]], dtype=bool)
    wrapped, mask, slot = markers.wrap(x, pad)
    assert wrapped[..., 0].tolist() == [
        [1, 2, -1, 3, 4, -2],  # left padding: [CLS] right before the first real token
        [-1, 1, 2, -2, 3, 4],  # right padding
        [1, -1, 2, 3, -2, 4],  # both sides
        [1, 2, 3, 4, -1, -2],  # nothing real: markers after the padding
    ]
    assert mask.tolist()[0] == [True, True, False, False, False, False]
    assert mask.tolist()[2] == [True, False, False, False, False, True]
    assert torch.equal(markers.unwrap(wrapped, slot), x)


def test_decoder_markers_with_left_padding_and_a_cache():
    model = build(urpe.TransformerDecoder, position="rpe", gate="toeplitz", markers=True)
    tokens = torch.randint(0, 11, (2, 8))
    pad = torch.zeros(2, 8, dtype=bool)
    pad[1, :3] = True  # row 1 is left-padded
    full = model(tokens, key_padding_mask=pad)
    cache = model.new_cache()
    first = model(tokens[:, :5], key_padding_mask=pad[:, :5], cache=cache)
    rest = model(tokens[:, 5:], cache=cache)
    torch.testing.assert_close(torch.cat([first, rest], 1), full, rtol=1e-10, atol=1e-10)
    alone = model(tokens[1:, 3:])  # row 1 without its padding
    torch.testing.assert_close(full[1:, 3:], alone, rtol=1e-10, atol=1e-10)


def test_markers_refuse_positions_and_attn_mask():
    model = build(urpe.TransformerEncoder, position="rpe", markers=True)
    with pytest.raises(ValueError, match="markers"):
        model(torch.ones(1, 3).long(), positions=urpe.Positions.sequence(5))


@pytest.mark.parametrize("name", ["fire", "ape", "sinusoidal"])
def test_positions_counted_over_real_tokens_remove_left_padding(name):
    # Encodings that read absolute positions see left padding; positions counted over the real
    # tokens (Positions.from_padding) make each row as if it were alone.
    model = build(urpe.TransformerEncoder, **ABSOLUTE_TOO[name])
    real = torch.randint(0, 11, (1, 5))
    tokens = torch.cat([torch.zeros(1, 3).long(), real], 1)
    mask = torch.tensor([[True] * 3 + [False] * 5])
    got = model(tokens, mask, positions=urpe.Positions.from_padding(mask))[:, 3:]
    torch.testing.assert_close(got, model(real), rtol=1e-10, atol=1e-10)
    by_index = model(tokens, mask)[:, 3:]
    assert not torch.allclose(by_index, model(real))


# ------------------------------------------------------------------------------ graph relations
def test_relation_model_uses_the_relation_and_asks_for_it():
    model = build(urpe.TransformerEncoder, position="relation", gate="relation", num_relations=4)
    tokens = torch.randint(0, 11, (2, 5))
    relation = torch.randint(0, 4, (2, 5, 5))
    out = model(tokens, positions=urpe.Positions.graph(relation))
    other = model(tokens, positions=urpe.Positions.graph((relation + 1) % 4))
    assert out.shape == (2, 5, 16) and not torch.allclose(out, other)
    with pytest.raises(ValueError, match="Positions.graph"):
        model(tokens)
    with pytest.raises(ValueError, match="positions.relation"):
        model(tokens, positions=urpe.Positions.graph(relation + 4))


# ------------------------------------------------------------------------- precomputed terms
def test_precomputed_bias_and_gate_replace_the_modules_own():
    mha = urpe.MultiheadAttention(
        8, 2, position=urpe.RelativeBias(2, 3), gate=urpe.ToeplitzGate(2, 3), backend="reference"
    ).double()
    x = torch.randn(2, 4, 8, dtype=torch.float64)
    bias = torch.randn(2, 2, 4, 4, dtype=torch.float64)
    gate = torch.rand(1, 2, 4, 4, dtype=torch.float64) + 0.5
    got = mha(x, bias=bias, gate=gate, is_causal=True)
    heads = [p(x).view(2, 4, 2, 4).transpose(1, 2) for p in (mha.q_proj, mha.k_proj, mha.v_proj)]
    out = naive_attention(*heads, bias=bias, gate=gate, causal=True)
    want = mha.out_proj(out.transpose(1, 2).reshape(2, 4, 8))
    torch.testing.assert_close(got, want)
    shaw = urpe.MultiheadAttention(8, 2, position=urpe.ShawRelative(4, 3))
    with pytest.raises(ValueError, match="cannot replace"):
        shaw(x.float(), bias=bias.float())


class RecordingEncoding(urpe.NoPosition):
    """Records what reaches `attend`, to check threading through layers and models."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def attend(self, q, k, v, **kwargs):
        self.calls.append(kwargs)
        return v[..., -q.shape[-2] :, :]


def test_attn_mask_and_positions_reach_every_layer():
    model = build(urpe.TransformerDecoder, position="rpe")
    recorder = RecordingEncoding()
    for layer in model.layers:
        layer.mixer.position = recorder
    mask = torch.ones(1, 1, 4, 4, dtype=torch.bool).tril()
    positions = urpe.Positions.sequence(4, start=2)
    model(torch.randint(0, 11, (1, 4)), positions=positions, attn_mask=mask)
    assert len(recorder.calls) == 2
    for call in recorder.calls:
        assert call["attn_mask"] is mask and call["positions"] is positions
    recorder.calls.clear()
    model(torch.randint(0, 11, (1, 4)))
    assert all("attn_mask" not in call for call in recorder.calls)  # only passed when given


def test_mixers_refuse_what_they_would_ignore():
    model = build(urpe.TransformerEncoder, mixers={0: "conv"})
    with pytest.raises(NotImplementedError, match="attn_mask"):
        model(torch.ones(1, 3).long(), attn_mask=torch.ones(3, 3, dtype=bool))
    with pytest.raises(NotImplementedError, match="by index"):
        model(
            torch.ones(2, 3).long(),
            positions=urpe.Positions.from_padding(torch.zeros(2, 3, dtype=bool)),
        )


# --------------------------------------------------------------------------------- state dicts
def test_loading_across_share_position_fails_loudly():
    shared = build(urpe.TransformerEncoder, position="rpe", gate="toeplitz")
    apart = build(urpe.TransformerEncoder, position="rpe", gate="toeplitz", share_position=False)
    with pytest.raises(ValueError, match="share_position=False"):
        shared.load_state_dict(apart.state_dict())
    with pytest.raises(ValueError, match="share_position=True"):
        apart.load_state_dict(shared.state_dict())
    # Without the recorded setting (an old checkpoint, strict=False), differing values under
    # keys of one shared table are still refused.
    old = {k: v for k, v in apart.state_dict().items() if not k.endswith("_extra_state")}
    with pytest.raises(ValueError, match="different values"):
        shared.load_state_dict(old, strict=False)
    twin = build(urpe.TransformerEncoder, position="rpe", gate="toeplitz")
    twin.load_state_dict(shared.state_dict())
    tokens = torch.randint(0, 11, (2, 5))
    torch.testing.assert_close(twin(tokens), shared(tokens), rtol=0, atol=0)


# --------------------------------------------------------------------------------- registries
def test_a_registered_encoding_needs_no_other_edit():
    from urpe.encodings import RelativeEncoding, register_gate, register_position, registered

    class ConstantBias(RelativeEncoding):
        def __init__(self, heads):
            super().__init__()
            self.value = torch.nn.Parameter(torch.zeros(1, heads, 1, 1))

        def bias(self, q, positions, scale):
            return self.value.to(q.dtype)

    class HalfGate(torch.nn.Module):
        def forward(self, positions):
            return torch.full((1, 1, 1, 1), 0.5, dtype=torch.float64)

    constant = lambda s: ConstantBias(s.num_heads)  # noqa: E731
    with (
        registered(register_position, "test-constant", ConstantBias, constant),
        registered(register_gate, "test-half", HalfGate, lambda s: HalfGate()),
    ):
        assert "test-constant" in urpe.models.POSITIONS and "test-half" in urpe.models.GATES
        model = build(urpe.TransformerEncoder, position="test-constant", gate="test-half")
        assert isinstance(model.layers[1].mixer.position, ConstantBias)
        assert isinstance(model.layers[1].mixer.gate, HalfGate)
        assert model(torch.randint(0, 11, (1, 4))).shape == (1, 4, 16)
        with pytest.raises(ValueError, match="already taken"):
            register_position("rpe", constant)(ConstantBias)
    assert "test-constant" not in POSITION_REGISTRY and "test-half" not in GATE_REGISTRY
    with pytest.raises(ValueError, match="position must be one of"):
        urpe.TransformerConfig(vocab_size=5, position="test-constant")
