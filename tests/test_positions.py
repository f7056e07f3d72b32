"""`urpe.Positions` and the terms encodings and gates compute from it.

The structured (aligned, Toeplitz) path and the exact fallback (per-row positions: `Relation` or
dense terms) must give the same attention; RoPE must rotate by the given positions; relation-
indexed terms must equal their dense expansion, written out here by loops.
"""

import math

import pytest
import torch

import urpe
from urpe.encodings import GATE_REGISTRY, POSITION_REGISTRY, EncodingSettings
from urpe.kernels import Relation, Toeplitz

F64 = dict(dtype=torch.float64)
H, D, E = 2, 4, 8
SETTINGS = EncodingSettings(
    num_heads=H,
    head_dim=D,
    dim=E,
    max_length=6,
    num_relations=5,
    options={"num_buckets": 8, "bucket_max_distance": 16},
)
SEQUENCE_ENCODINGS = [n for n, r in POSITION_REGISTRY.items() if not r.uses_relation]
SEQUENCE_GATES = [None, *(n for n, r in GATE_REGISTRY.items() if not r.uses_relation)]


def randomized(module):
    """float64, every parameter moved well away from its init so it matters."""
    module = module.double()
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    return module


def attention_module(position_name, gate_name=None, causal=False):
    s = EncodingSettings(**{**SETTINGS.__dict__, "causal": causal})
    position = POSITION_REGISTRY[position_name].build(s)
    gate = GATE_REGISTRY[gate_name].build(s) if gate_name else None
    mha = urpe.MultiheadAttention(E, H, position=position, gate=gate, backend="reference")
    return randomized(mha).eval()


# ----------------------------------------------------------------------------------- the object
def test_sequence_constructor_places_queries_after_the_past():
    p = urpe.Positions.sequence(3, past=4)
    assert p.query.tolist() == [4, 5, 6] and p.key.tolist() == list(range(7))
    assert p.is_aligned and p.query_start == 4 and p.batch is None
    shifted = urpe.Positions.sequence(2, past=1, start=10)
    assert shifted.query.tolist() == [11, 12] and shifted.key.tolist() == [10, 11, 12]
    assert shifted.query_start == 11
    offsets = p.offsets()
    assert offsets.shape == (1, 3, 7) and offsets[0, 0, 0] == -4 and offsets[0, 2, 6] == 0


def test_from_padding_counts_real_tokens_per_row():
    mask = torch.tensor([[True, True, False, False, False], [False, False, False, True, True]])
    p = urpe.Positions.from_padding(mask)
    assert not p.is_aligned and p.batch == 2
    assert p.key[0, 2:].tolist() == [0, 1, 2] and p.key[1, :3].tolist() == [0, 1, 2]
    tail = urpe.Positions.from_padding(mask, query_length=2)
    assert tail.query.tolist() == [[1, 2], [2, 2]] and tail.key.shape == (2, 5)


def test_graph_constructor_carries_the_relation():
    rel = torch.randint(0, 4, (3, 5, 5))
    p = urpe.Positions.graph(rel)
    assert p.relation is rel and p.is_aligned and p.query_length == p.key_length == 5
    assert p.with_relation(None).relation is None and p.with_relation(None).is_aligned


def test_contiguous_positions_are_aligned_offsets_plus_one_shift():
    """Queries inside a longer key buffer (a static KV cache), the start a tensor or an int."""
    for start in (torch.tensor(3), 3):
        p = urpe.Positions.contiguous(2, 8, start, 0)
        assert p.query.tolist() == [3, 4] and p.key.tolist() == list(range(8))
        assert not p.is_aligned and p.batch is None and repr(p).count("contiguous") == 1
        # key - query = (j - (i + Lk - Lq)) + shift
        assert int(p.toeplitz_shift) == 0 - 3 + (8 - 2)
        aligned = urpe.Positions.sequence(2, past=6).offsets()
        torch.testing.assert_close(p.offsets(), aligned + p.toeplitz_shift)
        assert p.with_relation(torch.zeros(1, 2, 8).long()).toeplitz_shift is p.toeplitz_shift
    assert urpe.Positions.sequence(3).toeplitz_shift is None
    assert urpe.Positions(torch.arange(2), torch.arange(3)).toeplitz_shift is None


@pytest.mark.parametrize(
    "build, error, match",
    [
        (lambda: urpe.Positions.contiguous(2, 3, 1.0, 0), TypeError, "query_start"),
        (lambda: urpe.Positions.contiguous(2, 3, 0, torch.zeros(1).long()), TypeError, "key_start"),
        (lambda: urpe.Positions(torch.arange(3.0), torch.arange(3)), TypeError, "integer"),
        (
            lambda: urpe.Positions(torch.zeros(1, 1, 3).long(), torch.arange(3)),
            ValueError,
            "positions.query",
        ),
        (
            lambda: urpe.Positions(torch.zeros(2, 3).long(), torch.zeros(3, 3).long()),
            ValueError,
            "rows",
        ),
        (
            lambda: urpe.Positions(torch.arange(3), torch.arange(4), torch.zeros(1, 3, 3).long()),
            ValueError,
            "relation",
        ),
        (lambda: urpe.Positions.graph(torch.zeros(2, 3, 4).long()), ValueError, "graph"),
        (lambda: urpe.Positions.sequence(3, past=-1), ValueError, "past"),
        (lambda: urpe.Positions.sequence(2.0), TypeError, "length"),
        (lambda: urpe.Positions.from_padding(torch.zeros(2, 3)), TypeError, "bool"),
        (
            lambda: urpe.Positions.from_padding(torch.zeros(2, 3, dtype=bool), 4),
            ValueError,
            "query_length",
        ),
    ],
)
def test_bad_positions_are_refused(build, error, match):
    with pytest.raises(error, match=match):
        build()


def test_attention_refuses_positions_of_the_wrong_shape():
    mha = urpe.MultiheadAttention(E, H, position=urpe.RelativeBias(H, 4))
    x = torch.randn(2, 5, E)
    with pytest.raises(ValueError, match="4 queries over 4 keys"):
        mha(x, positions=urpe.Positions.sequence(4))
    with pytest.raises(ValueError, match="batch of 3"):
        mha(x, positions=urpe.Positions(torch.zeros(3, 5).long(), torch.zeros(3, 5).long()))
    with pytest.raises(TypeError, match="urpe.Positions"):
        mha(x, positions=torch.arange(5))


# ----------------------------------------------------- structured path == exact fallback, per row
@pytest.mark.parametrize("gate", SEQUENCE_GATES)
@pytest.mark.parametrize("name", SEQUENCE_ENCODINGS)
def test_per_row_positions_equal_each_row_alone(name, gate):
    """Row b at positions s_b.. (per-row, the fallback terms) equals that row run alone with
    aligned positions starting at s_b (the structured terms), with a KV-cache-like past."""
    mha = attention_module(name, gate, causal=True)
    b, past, lq = 3, 2, 4
    x = torch.randn(b, past + lq, E, **F64)
    starts = torch.tensor([0, 5, 11])
    key = starts[:, None] + torch.arange(past + lq)  # (B, Lk)
    per_row = urpe.Positions(key[:, past:], key)
    memory, segment = x[:, :past], x[:, past:]
    out = mha(segment, memory=memory, positions=per_row, is_causal=True)
    for row, start in enumerate(starts.tolist()):
        alone = urpe.Positions.sequence(lq, past=past, start=start)
        want = mha(
            segment[row : row + 1], memory=memory[row : row + 1], positions=alone, is_causal=True
        )
        torch.testing.assert_close(out[row : row + 1], want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", SEQUENCE_ENCODINGS)
def test_explicit_positions_equal_the_default_on_cross_attention(name):
    # Lq != Lk without a cache: the default is urpe.attention's alignment (queries last).
    mha = attention_module(name)
    x, context = torch.randn(2, 3, E, **F64), torch.randn(2, 7, E, **F64)
    explicit = urpe.Positions(torch.arange(4, 7), torch.arange(7))  # not marked aligned
    torch.testing.assert_close(
        mha(x, context, positions=explicit), mha(x, context), rtol=1e-10, atol=1e-10
    )


@pytest.mark.parametrize(
    "name", [n for n in SEQUENCE_ENCODINGS if POSITION_REGISTRY[n].cls.shift_invariant]
)
def test_shift_invariant_encodings_ignore_a_common_shift(name):
    mha = attention_module(name, "toeplitz")
    x = torch.randn(2, 5, E, **F64)
    shifted = urpe.Positions(torch.arange(5) + 100, torch.arange(5) + 100)
    torch.testing.assert_close(mha(x, positions=shifted), mha(x), rtol=1e-10, atol=1e-10)


def test_relative_bias_and_gate_fall_back_to_an_exact_relation():
    positions = urpe.Positions(torch.tensor([[3, 9]]), torch.tensor([[0, 2, 9, 20]]))
    bias = urpe.RelativeBias(H, 3)
    term = bias.bias(torch.zeros(1, H, 2, D), positions, 1.0)
    assert isinstance(term, Relation)
    dense = term.dense(2, 4)[0]
    for i, pq in enumerate([3, 9]):
        for j, pk in enumerate([0, 2, 9, 20]):
            torch.testing.assert_close(dense[:, i, j], bias.table[:, min(max(pk - pq, -3), 3) + 3])
    gate = urpe.ToeplitzGate(H, 2, init="normal", activation="softplus")
    c = gate(positions).dense(2, 4)[0]
    assert torch.allclose(c[:, 1, 3], torch.nn.functional.softplus(gate.table[:, 4]))
    assert isinstance(gate(urpe.Positions.sequence(2)), Toeplitz)


CONTIGUOUS_CASES = [(n, "toeplitz") for n in SEQUENCE_ENCODINGS] + [
    ("none", g) for g in SEQUENCE_GATES if g not in (None, "toeplitz")
]


@pytest.mark.parametrize(("name", "gate"), CONTIGUOUS_CASES)
def test_contiguous_positions_equal_the_exact_fallback_forward_and_backward(name, gate):
    """A static cache's queries at a tensor start inside the key buffer: the terms computed from
    the shift (Toeplitz gates and RPE-style biases stay Toeplitz) give the attention, and the
    gradients, of the same positions given as plain tensors (the exact Relation fallback)."""
    mha = attention_module(name, gate)
    lq, past, start = 2, 6, torch.tensor(3)  # queries at 3, 4 over keys 0..7
    x = torch.randn(2, past + lq, E, **F64)
    contiguous = urpe.Positions.contiguous(lq, past + lq, start, 0)
    exact = urpe.Positions(contiguous.query, contiguous.key)
    results = []
    for positions in (contiguous, exact):
        mha.zero_grad()
        out = mha(x[:, past:], memory=x[:, :past], positions=positions)
        out.square().sum().backward()
        results.append((out, [p.grad.clone() for p in mha.parameters()]))
    (out, grads), (want, want_grads) = results
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    for grad, want_grad in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(grad, want_grad, rtol=1e-10, atol=1e-10)
    if gate is not None:
        assert isinstance(mha.gate(contiguous), Toeplitz)


def test_alibi_and_kerple_off_the_grid_are_dense_functions_of_distance():
    positions = urpe.Positions(torch.tensor([0, 50]), torch.tensor([0, 7, 50]))
    alibi = urpe.ALiBi(4).bias(torch.zeros(1, 4, 2, D), positions, 1.0)
    assert alibi.shape == (1, 4, 2, 3)
    torch.testing.assert_close(alibi[0, :, 1, 1], -urpe.encodings.alibi_slopes(4) * 43)
    kerple = urpe.KerpleBias(4, "log")
    term = kerple.bias(torch.zeros(1, 4, 2, D), positions, 1.0)
    # KERPLE's log kernel from its raw parameters: r = softplus(raw) + eps (the paper's form)
    r1 = torch.nn.functional.softplus(kerple.raw_r1) + kerple.eps
    r2 = torch.nn.functional.softplus(kerple.raw_r2) + kerple.eps
    torch.testing.assert_close(term[0, :, 0, 2], -r1 * torch.log1p(r2 * 50))
    # off the grid the same distance gives the same value as on it (pair 0 -> 50 vs 7 -> 57)
    grid = kerple.bias(torch.zeros(1, 4, 1, D), urpe.Positions.sequence(1, past=50), 1.0)
    torch.testing.assert_close(grid.dense(1, 51)[0, :, 0, 0], term[0, :, 1, 0])


# -------------------------------------------------------------------------------------- RoPE
def rotate_by_hand(x, positions, base=10000.0):
    """RoPE as complex multiplication: channel pairs (c, c + D/2) times exp(i p theta_c)."""
    d = x.shape[-1]
    theta = base ** (-torch.arange(0, d, 2, **F64) / d)
    z = torch.complex(x[..., : d // 2], x[..., d // 2 :])
    z = z * torch.polar(torch.ones_like(theta), positions.double()[..., None] * theta)
    return torch.cat([z.real, z.imag], -1)


def test_rope_rotates_by_the_given_positions_per_row():
    rope = urpe.RotaryEncoding(8).double()
    x = torch.randn(2, 3, 5, 8, **F64)
    per_row = torch.tensor([[0, 1, 2, 3, 4], [7, 9, 10, 30, 31]])
    got = rope.rotate(x, per_row)
    for row in range(2):
        torch.testing.assert_close(got[row], rotate_by_hand(x[row], per_row[row]))
    torch.testing.assert_close(rope.rotate(x, per_row[1]), rotate_by_hand(x, per_row[1]))
    with pytest.raises(ValueError, match="RoPE positions"):
        rope.rotate(x, torch.arange(4))


def test_rope_attention_uses_the_given_positions():
    # Two queries at positions 0 and 6 against keys at 3 and 6: scores must depend on those
    # offsets. Reference computed from the projections by hand.
    mha = randomized(urpe.MultiheadAttention(E, H, position=urpe.RotaryEncoding(E // H)))
    mha.backend = "reference"
    x = torch.randn(1, 2, E, **F64)
    positions = urpe.Positions(torch.tensor([0, 6]), torch.tensor([3, 6]))
    got = mha(x, positions=positions)
    q = mha.q_proj(x).view(1, 2, H, D).transpose(1, 2)
    k = mha.k_proj(x).view(1, 2, H, D).transpose(1, 2)
    v = mha.v_proj(x).view(1, 2, H, D).transpose(1, 2)
    q, k = rotate_by_hand(q, torch.tensor([0, 6])), rotate_by_hand(k, torch.tensor([3, 6]))
    weights = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(D), -1)
    want = mha.out_proj((weights @ v).transpose(1, 2).reshape(1, 2, E))
    torch.testing.assert_close(got, want)


def test_fire_reads_the_given_query_positions():
    fire = randomized(urpe.FireBias(H, init_threshold=2.0))
    q = torch.zeros(1, H, 2, D, **F64)
    term = fire.bias(q, urpe.Positions(torch.tensor([[4, 9]]), torch.tensor([[1, 9]])), 1.0)
    c = fire.log_c.exp()
    for i, pq in enumerate([4, 9]):
        for j, pk in enumerate([1, 9]):
            d = pk - pq
            feature = torch.stack(
                [
                    torch.log1p(c * abs(d))
                    / (torch.log1p(c * max(pq, fire.threshold.abs().item())) + 1e-6),
                    torch.tensor(float(d > 0), **F64),
                ]
            )
            torch.testing.assert_close(term[0, :, i, j], fire.mlp(feature))


# ---------------------------------------------------------------------------- relation terms
def relation_by_hand(table, relation):
    b, lq, lk = relation.shape
    out = torch.empty(b, table.shape[0], lq, lk, dtype=table.dtype)
    for bi in range(b):
        for i in range(lq):
            for j in range(lk):
                out[bi, :, i, j] = table[:, relation[bi, i, j]]
    return out


def test_relation_bias_and_gate_equal_their_dense_expansion():
    relation = torch.randint(0, 5, (2, 6, 6))
    positions = urpe.Positions.graph(relation)
    bias = randomized(urpe.RelationBias(H, 5))
    gate = randomized(urpe.RelationGate(H, 5, activation="softplus"))
    mha = randomized(urpe.MultiheadAttention(E, H, position=bias, gate=gate)).eval()
    plain = urpe.MultiheadAttention(E, H, backend="reference").double()
    plain.load_state_dict(mha.state_dict(), strict=False)
    x = torch.randn(2, 6, E, **F64)
    dense_b = relation_by_hand(bias.table.detach(), relation)
    dense_c = relation_by_hand(torch.nn.functional.softplus(gate.table.detach()), relation)
    for backend in ("reference", "auto"):
        mha.backend = backend
        got = mha(x, positions=positions)
        want = plain(x, bias=dense_b, gate=dense_c)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    assert torch.equal(gate(positions).dense(6, 6), dense_c)


def test_relation_gate_starts_at_ones():
    gate = urpe.RelationGate(3, 4)
    positions = urpe.Positions.graph(torch.randint(0, 4, (2, 3, 3)))
    assert torch.equal(gate(positions).dense(3, 3), torch.ones(2, 3, 3, 3))
    assert urpe.RelationBias(3, 4).table.std() < 0.1


@pytest.mark.parametrize("module", [urpe.RelationBias(H, 4), urpe.RelationGate(H, 4)])
@pytest.mark.parametrize("bad", [-1, 4])
def test_relation_indices_out_of_range_name_the_argument(module, bad):
    relation = torch.zeros(1, 3, 3, dtype=torch.long)
    relation[0, 1, 2] = bad
    role = "position" if isinstance(module, urpe.RelationBias) else "gate"
    mha = urpe.MultiheadAttention(E, H, **{role: module})
    with pytest.raises(ValueError, match=r"positions\.relation must hold indices in \[0, 4\)"):
        mha(torch.randn(1, 3, E), positions=urpe.Positions.graph(relation))


def test_relation_modules_need_a_relation():
    mha = urpe.MultiheadAttention(E, H, position=urpe.RelationBias(H, 4))
    with pytest.raises(ValueError, match="Positions.graph"):
        mha(torch.randn(1, 3, E))


# ---------------------------------------------------------------------------------- the gate
def test_toeplitz_gate_without_a_length_is_refused():
    with pytest.raises(ValueError, match="not position-aware"):
        urpe.ToeplitzGate(num_heads=4)
    with pytest.raises(ValueError, match="not position-aware"):
        urpe.ToeplitzGate(4, 0)
    with pytest.raises(ValueError, match="not both"):
        urpe.ToeplitzGate(4, 3, num_buckets=8)
    with pytest.raises(ValueError, match="num_buckets"):
        urpe.ToeplitzGate(4, num_buckets=3)
    # A model built for length 1 still gets a position-aware gate (K = 1).
    config = urpe.TransformerConfig(
        vocab_size=5, max_len=1, num_layers=1, dim=8, num_heads=2, position="rpe", gate="toeplitz"
    )
    assert urpe.TransformerEncoder(config).layers[0].mixer.gate.table.shape == (2, 3)
