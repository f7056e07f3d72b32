"""Each positional encoding against its published formula, computed independently here."""

import math

import pytest
import torch

import urpe
from urpe.encodings import alibi_slopes, sinusoid, t5_buckets

F64 = dict(dtype=torch.float64)
SEQ = urpe.Positions.sequence


def dense(term, lq, lk):
    return term.dense(lq, lk) if not isinstance(term, torch.Tensor) else term


def test_relative_bias_is_the_table_per_offset_with_clipping():
    enc = urpe.RelativeBias(num_heads=2, max_distance=3)
    b = dense(enc.bias(torch.zeros(1, 2, 8, 4), SEQ(8), 1.0), 8, 8)[0]  # (H, L, L)
    for i, j in [(0, 0), (2, 5), (5, 2), (0, 7), (7, 0)]:
        d = max(-3, min(3, j - i))
        assert torch.equal(b[:, i, j], enc.table[:, d + 3])


def test_t5_buckets_known_values():
    offsets = torch.tensor([0, -1, -7, -8, -20, -127, -128, -1000, 1, 8])
    got = t5_buckets(offsets, num_buckets=32, max_distance=128).tolist()
    # Keys before the query (d < 0) use buckets 0..15; exact below 8, then log-spaced to 128.
    assert got[:4] == [0, 1, 7, 8]
    assert got[4] == 8 + int(math.log(20 / 8) / math.log(128 / 8) * 8)
    assert got[5] == 15 and got[6] == 15 and got[7] == 15
    assert got[8] == 17 and got[9] == 16 + 8  # keys after the query: the upper half
    uni = t5_buckets(torch.tensor([3, 0, -3]), num_buckets=32, bidirectional=False).tolist()
    assert uni == [0, 0, 3]


def test_alibi_slopes_match_the_paper():
    assert torch.allclose(alibi_slopes(8), torch.tensor([2.0 ** -(i + 1) for i in range(8)]))
    s6 = alibi_slopes(6)  # 4 from the power of two below, 2 interleaved from 8
    assert torch.allclose(s6, torch.tensor([2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3]))
    enc = urpe.ALiBi(num_heads=8)
    b = dense(enc.bias(torch.zeros(1, 8, 5, 4), SEQ(5), 1.0), 5, 5)[0]
    assert torch.isclose(b[2, 4, 1], torch.tensor(-3 * 2.0**-3))
    assert torch.isclose(b[2, 1, 4], torch.tensor(-3 * 2.0**-3))


def softplus(x: float) -> float:
    return math.log1p(math.exp(x))


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


@pytest.mark.parametrize("kind", ["log", "power"])
def test_kerple_formulas(kind):
    enc = urpe.KerpleBias(num_heads=2, kind=kind).double()
    raw1, raw2 = [0.3, -0.2], [0.1, 0.5]
    with torch.no_grad():
        enc.raw_r1.copy_(torch.tensor(raw1, **F64))
        enc.raw_r2.copy_(torch.tensor(raw2, **F64))
    b = dense(enc.bias(torch.zeros(1, 2, 6, 4, **F64), SEQ(6), 1.0), 6, 6)[0]
    # The documented parameterisation, written out here (not read from the module).
    for h in range(2):
        r1 = 0.01 + softplus(raw1[h])
        if kind == "log":
            r2 = 0.01 + softplus(raw2[h])
            want = -r1 * math.log1p(r2 * 4)
        else:
            r2 = 2 - (2 - 0.01) * sigmoid(-raw2[h])
            want = -r1 * 4.0**r2
        assert b[h, 5, 1].item() == pytest.approx(want, rel=1e-12)
        assert b[h, 1, 5].item() == pytest.approx(want, rel=1e-12)
    assert (b <= 0).all() and (b[:, 3, 3] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_kerple_power_exponent_never_exceeds_two(dtype):
    """Above 2, |j - i|^r2 is no longer conditionally positive definite: the bound is exact."""
    enc = urpe.KerpleBias(num_heads=5, kind="power").to(dtype)
    with torch.no_grad():
        enc.raw_r1.zero_()
        enc.raw_r2.copy_(torch.tensor([-60.0, 0.0, 5.0, 30.0, 200.0]))
    length = 40
    b = dense(enc.bias(torch.zeros(1, 5, length, 4, dtype=dtype), SEQ(length), 1.0), length, length)
    b = b[0, :, length - 1].double()  # (H, L): distances 39..0 from the last query
    r1 = -b[:, length - 2]  # distance 1: -r1 * 1^r2
    exponent = torch.log(b[:, 0] / b[:, length - 2]) / math.log(length - 1)  # from d = 39 vs 1
    tolerance = 1e-12 if dtype == torch.float64 else 1e-6
    assert (exponent <= 2 + tolerance).all() and (exponent > 0).all()
    # A saturated exponent is the official clamp at 2: -r1 d^2 (today's 2.01 was off by 57).
    distance = torch.arange(length - 1, -1, -1, dtype=torch.float64)
    for h in (3, 4):
        torch.testing.assert_close(b[h], -r1[h] * distance**2, rtol=tolerance, atol=0)


def test_fire_depends_on_query_position_and_extrapolates():
    enc = urpe.FireBias(num_heads=3, init_threshold=4.0).double()
    b = enc.bias(torch.zeros(1, 3, 10, 4, **F64), SEQ(10), 1.0)
    assert b.shape == (1, 3, 10, 10)
    # Same offset (-2) at different query positions beyond the threshold: different values.
    assert not torch.allclose(b[0, :, 6, 4], b[0, :, 9, 7])
    # Below the threshold the normaliser is constant, so the bias is Toeplitz there.
    torch.testing.assert_close(b[0, :, 2, 0], b[0, :, 3, 1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("threshold", [0.0, -0.0, 1e-30])
def test_fire_stays_finite_when_its_threshold_reaches_zero(dtype, threshold):
    """The query at position 0 divides by psi(max(0, L)); the paper adds eps = 1e-6 there."""
    enc = urpe.FireBias(num_heads=2, init_threshold=4.0).to(dtype)
    with torch.no_grad():
        enc.threshold.fill_(threshold)
    for positions in (SEQ(6), urpe.Positions(torch.tensor([[0, 3]]), torch.tensor([[0, 2, 5]]))):
        b = enc.bias(torch.zeros(1, 2, positions.query_length, 4, dtype=dtype), positions, 1.0)
        assert torch.isfinite(b).all()
        enc.zero_grad()
        b.sum().backward()
        for name, p in enc.named_parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all(), name
    # Query 0 against key 2: psi(2) / (psi(0) + eps) = log(1 + 2c) / 1e-6, by hand.
    b = enc.bias(torch.zeros(1, 2, 3, 4, dtype=dtype), SEQ(3), 1.0)
    c = math.exp(enc.log_c.item())
    feature = torch.tensor([math.log1p(2 * c) / 1e-6, 1.0], dtype=dtype)
    torch.testing.assert_close(b[0, :, 0, 2], enc.mlp(feature), rtol=1e-5, atol=1e-3)


def test_rope_scores_depend_on_offset_only():
    enc = urpe.RotaryEncoding(head_dim=8)
    q, k = torch.randn(1, 1, 1, 8, **F64), torch.randn(1, 1, 1, 8, **F64)
    enc = enc.double()

    def score(i, j):
        qi = enc.rotate(q, torch.tensor([i]))
        kj = enc.rotate(k, torch.tensor([j]))
        return (qi * kj).sum()

    torch.testing.assert_close(score(3, 1), score(10, 8))
    torch.testing.assert_close(score(0, 0), (q * k).sum())
    assert not torch.isclose(score(3, 1), score(1, 3))


def test_shaw_matches_its_formula():
    b, h, l, d = 1, 2, 5, 4
    enc = urpe.ShawRelative(head_dim=d, max_distance=2).double()
    with torch.no_grad():
        enc.keys.normal_()
        enc.values.normal_()
    q, k, v = (torch.randn(b, h, l, d, **F64) for _ in range(3))
    out = enc.attend(q, k, v, positions=SEQ(l), scale=0.5)
    want = torch.zeros_like(out)
    for hi in range(h):
        for i in range(l):
            idx = [max(-2, min(2, j - i)) + 2 for j in range(l)]
            s = torch.stack(
                [0.5 * q[0, hi, i] @ (k[0, hi, j] + enc.keys[idx[j]]) for j in range(l)]
            )
            a = torch.softmax(s, 0)
            want[0, hi, i] = sum(a[j] * (v[0, hi, j] + enc.values[idx[j]]) for j in range(l))
    torch.testing.assert_close(out, want)


def test_transformer_xl_matches_its_formula():
    b, h, l, d, dim = 1, 2, 4, 3, 6
    enc = urpe.TransformerXLRelative(dim, h, d).double()
    q, k, v = (torch.randn(b, h, l, d, **F64) for _ in range(3))
    out = enc.attend(q, k, v, positions=SEQ(l), scale=0.5, backend="reference")
    w_r = enc.project.weight.view(h, d, dim)
    u, vb = enc.content_bias[:, 0], enc.position_bias[:, 0]
    want = torch.zeros_like(out)
    for hi in range(h):
        for i in range(l):
            r = sinusoid(torch.tensor([i - j for j in range(l)]), dim).double()  # (L, dim)
            qi = q[0, hi, i]
            s = torch.stack(
                [
                    0.5 * ((qi + u[hi]) @ k[0, hi, j] + (qi + vb[hi]) @ (w_r[hi] @ r[j]))
                    for j in range(l)
                ]
            )
            want[0, hi, i] = torch.softmax(s, 0) @ v[0, hi]
    torch.testing.assert_close(out, want)


def test_sinusoid_values():
    table = sinusoid(torch.tensor([0, 1, 5]), 4)
    assert torch.allclose(table[0], torch.tensor([0.0, 0.0, 1.0, 1.0]))
    assert torch.isclose(table[2, 0], torch.tensor(math.sin(5.0)))
    assert torch.isclose(table[2, 1], torch.tensor(math.sin(5.0 / 100)))


def test_gate_defaults_to_ones_and_options_apply():
    gate = urpe.ToeplitzGate(num_heads=2, max_distance=3)
    assert torch.equal(gate(SEQ(4)).dense(4, 4), torch.ones(1, 2, 4, 4))
    normal = urpe.ToeplitzGate(2, 3, init="normal", init_std=1.0)
    assert normal.table.std() > 0.3
    relu = urpe.ToeplitzGate(2, 3, init="normal", init_std=1.0, activation="relu")
    assert (relu(SEQ(4)).table >= 0).all() and (relu.table < 0).any()
    bucketed = urpe.ToeplitzGate(2, num_buckets=8, bucket_max_distance=16)
    assert bucketed.table.shape == (2, 8) and bucketed(SEQ(5)).table.shape == (2, 9)
    with pytest.raises(ValueError, match="init must be"):
        urpe.ToeplitzGate(2, 3, init="zeros")


def test_gate_gradients_reach_the_table():
    gate = urpe.ToeplitzGate(2, 2, num_buckets=None).double()
    q, k, v = (torch.randn(1, 2, 5, 4, **F64) for _ in range(3))
    urpe.attention(q, k, v, gate=gate(SEQ(5))).sum().backward()
    assert gate.table.grad is not None and gate.table.grad.abs().sum() > 0
