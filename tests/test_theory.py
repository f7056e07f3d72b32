"""The paper's theorem as a test: on identical tokens, a model whose only position signal sits
inside the softmax outputs the same vector at every position, at any depth; URPE and the other
row-sum-breaking designs do not."""

import pytest
import torch

import urpe
from urpe.encodings import ABSOLUTE_REGISTRY, GATE_REGISTRY, POSITION_REGISTRY

SEQUENCE = {n: r for n, r in POSITION_REGISTRY.items() if not r.uses_relation}
SEQUENCE_GATES = [n for n, r in GATE_REGISTRY.items() if not r.uses_relation]

# Position enters only the logits before a softmax: rows sum to 1, so identical values give
# identical outputs. Read from the registry: every encoding that does not touch the values.
INSIDE_SOFTMAX = {
    **{n: dict(position=n) for n, r in SEQUENCE.items() if not r.cls.value_side},
    **{f"rpe-with-ones-{g}-gate": dict(position="rpe", gate=g) for g in SEQUENCE_GATES},
}  # a gate at its init (ones): URPE at init is RPE
# Designs that break the row-sum constraint or give tokens positions of their own.
POSITION_AWARE = {
    **{f"urpe-{g}": dict(position="rpe", gate=g) for g in SEQUENCE_GATES},
    "urpe-t5": dict(position="t5", gate="t5"),
    "exp": dict(position="rpe", normalization="exp"),
    "l2": dict(position="rpe", normalization="l2"),
    "relu2": dict(position="rpe", normalization="relu2"),
    **{n: dict(position=n) for n, r in SEQUENCE.items() if r.cls.value_side},
    **{f"absolute-{n}": dict(absolute=n) for n in ABSOLUTE_REGISTRY},
    "markers": dict(position="rpe", markers=True),
    "bilinear-mixer": dict(position="rpe", mixers={0: "bilinear"}),
}


def randomized_model(kind, depth, **overrides):
    config = urpe.TransformerConfig(
        vocab_size=7, max_len=12, num_layers=depth, dim=16, num_heads=2, **overrides
    )
    model = kind(config).double().eval()
    with torch.no_grad():  # strong, random position parameters; a gate stays at its init (ones)
        for name, p in model.named_parameters():
            if "position" in name or "absolute" in name or "markers" in name:
                p.add_(torch.randn_like(p) * 0.5)
    return model


def spread_over_positions(model, length=10):
    tokens = torch.full((2, length), 3)
    out = model(tokens)  # (B, L, E or V)
    return (out - out[:, :1]).abs().max().item()


@pytest.mark.parametrize("depth", [1, 4])
@pytest.mark.parametrize("name", INSIDE_SOFTMAX)
@pytest.mark.parametrize("kind", [urpe.TransformerEncoder, urpe.TransformerDecoder])
def test_inside_softmax_encodings_cannot_tell_identical_tokens_apart(name, depth, kind):
    model = randomized_model(kind, depth, **INSIDE_SOFTMAX[name])
    assert spread_over_positions(model) < 1e-12


@pytest.mark.parametrize("depth", [1, 4])
@pytest.mark.parametrize("name", POSITION_AWARE)
def test_row_sum_breaking_designs_tell_identical_tokens_apart(name, depth):
    overrides = dict(POSITION_AWARE[name])
    model = randomized_model(urpe.TransformerEncoder, depth, **overrides)
    if overrides.get("gate"):
        with torch.no_grad():
            for layer in model.layers:
                layer.mixer.gate.table.add_(torch.randn_like(layer.mixer.gate.table) * 0.5)
    assert spread_over_positions(model) > 1e-4


# Purely relative designs: outputs depend on offsets, never on absolute positions. (FIRE is left
# out, by its `shift_invariant` flag: it normalises offsets by the query position.)
SHIFT_INVARIANT = {
    name: overrides
    for name, overrides in {**INSIDE_SOFTMAX, **POSITION_AWARE}.items()
    if POSITION_REGISTRY[overrides.get("position", "none")].cls.shift_invariant
    and "absolute" not in overrides
    and not overrides.get("markers")
    and not overrides.get("mixers")
}


@pytest.mark.parametrize("name", SHIFT_INVARIANT)
def test_relative_designs_see_no_absolute_position(name):
    # The same random tokens, once at positions 0.. and once shifted right behind masked padding:
    # a purely relative model must give the real tokens the same outputs. This is why RoPE
    # solving PI on random tokens (results/synthetic) is not a leak of absolute positions.
    overrides = dict(SHIFT_INVARIANT[name])
    model = randomized_model(urpe.TransformerEncoder, 3, **overrides)
    if overrides.get("gate"):
        with torch.no_grad():
            for layer in model.layers:
                layer.mixer.gate.table.add_(torch.randn_like(layer.mixer.gate.table) * 0.5)
    tokens = torch.randint(0, 7, (2, 8), generator=torch.Generator().manual_seed(0))
    pad = 3
    shifted = torch.cat([torch.zeros(2, pad, dtype=torch.long), tokens], 1)
    padding = torch.zeros(2, 8 + pad, dtype=torch.bool)
    padding[:, :pad] = True
    with torch.no_grad():
        plain, behind = model(tokens), model(shifted, key_padding_mask=padding)[:, pad:]
    torch.testing.assert_close(behind, plain, atol=1e-12, rtol=0)
