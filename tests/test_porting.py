"""Converters of urpe.encodings.porting: weights in the original's format, converted, give the
original's outputs. Each original is transcribed here from its published code as plain loops
or tensor code that shares nothing with urpe (no package ships these originals)."""

from __future__ import annotations

import math

import pytest
import torch

import urpe
from urpe.encodings import porting

F64 = dict(dtype=torch.float64)
SEQ = urpe.Positions.sequence


def dense(term, lq, lk):
    return term if isinstance(term, torch.Tensor) else term.dense(lq, lk)


def report(name, got, want, rtol=1e-12):
    """Assert equality to float64 rounding and print the measured errors (pytest -s shows them)."""
    err = (got - want).abs()
    rel = (err / want.abs().clamp_min(1e-300)).max().item()
    print(f"{name}: max abs error {err.max().item():.3g}, max rel error {rel:.3g}")
    torch.testing.assert_close(got, want, rtol=rtol, atol=1e-12)


# -------------------------------------------------------------------------------------- KERPLE
def official_kerple(kind, p, a, length, eps=1e-2):
    """chijames/KERPLE `ParallelKerpleLog` / `ParallelKerplePower` (bias only): the distance
    matrix is tril(i - j) (0 above the diagonal), the parameters are clamped before use."""
    i = torch.arange(length)[:, None]
    j = torch.arange(length)[None, :]
    diff = torch.tril(i - j).to(torch.float64)  # (L, L)
    p, a = p.reshape(-1, 1, 1), a.reshape(-1, 1, 1)
    if kind == "log":
        return -p.clamp(min=eps) * torch.log(1 + a.clamp(min=eps) * diff)
    return -a.clamp(min=eps) * diff.pow(p.clamp(min=eps, max=2))


@pytest.mark.parametrize("kind", ["log", "power"])
def test_kerple_from_official_gives_the_official_bias(kind):
    # Values inside the ranges, on the bounds and past them (the official code clamps those).
    p = torch.tensor([0.005, 0.01, 0.3, 1.2, 1.999, 2.0, 2.7], **F64)
    a = torch.tensor([0.7, 0.01, 0.002, 1.5, 0.25, 3.0, 0.04], **F64)
    enc = urpe.KerpleBias(num_heads=7, kind=kind).double()
    enc.load_state_dict(porting.kerple_from_official(kind, p[:, None, None], a[:, None, None]))
    length = 40
    got = dense(enc.bias(torch.zeros(1, 7, length, 4, **F64), SEQ(length), 1.0), length, length)
    causal = torch.tril(torch.ones(length, length, dtype=torch.bool))  # the official is causal
    want = official_kerple(kind, p, a, length)
    # Values on a bound convert to raw values 1e-14 inside it: relative errors of ~1e-12.
    report(f"kerple-{kind} vs official", got[0][:, causal], want[:, causal], rtol=1e-11)


def test_kerple_from_official_checks_its_inputs():
    with pytest.raises(ValueError, match="kind"):
        porting.kerple_from_official("cubic", torch.ones(2), torch.ones(2))
    with pytest.raises(ValueError, match="one value per head"):
        porting.kerple_from_official("log", torch.ones(2), torch.ones(3))


# ---------------------------------------------------------------------------------------- FIRE
def paper_fire(state, length, eps=1e-6):
    """The FIRE paper's reference module (Li et al. 2024, appendix), bias only."""
    positions = torch.arange(length, **F64)
    rel = positions[:, None] - positions[None, :]
    threshold = torch.abs(state["L_multiplier"] * state["init_L"])
    normaliser = torch.max(positions, threshold)[:, None]
    rel = torch.log(torch.abs(state["c"] * rel) + 1)
    normaliser = torch.log(torch.abs(state["c"] * normaliser) + 1) + eps
    x = (rel / normaliser)[..., None]  # (L, L, 1)
    hidden = torch.relu(x @ state["mlp.0.weight"].T + state["mlp.0.bias"])
    out = hidden @ state["mlp.2.weight"].T + state["mlp.2.bias"]  # (L, L, H)
    return out.permute(2, 0, 1)  # (H, L, L)


def random_paper_fire_state(heads=3, hidden=32, c=-0.3, init_l=512.0, multiplier=0.01):
    g = torch.Generator().manual_seed(0)
    return {
        "c": torch.tensor(c, **F64),
        "init_L": torch.tensor(init_l, **F64),
        "L_multiplier": torch.tensor(multiplier, **F64),
        "mlp.0.weight": torch.randn(hidden, 1, generator=g, **F64),
        "mlp.0.bias": torch.randn(hidden, generator=g, **F64),
        "mlp.2.weight": torch.randn(heads, hidden, generator=g, **F64),
        "mlp.2.bias": torch.randn(heads, generator=g, **F64),
    }


@pytest.mark.parametrize("multiplier", [0.01, 0.0, -0.004])  # L = 5.12, 0, 2.048
def test_fire_from_paper_gives_the_paper_bias(multiplier):
    state = random_paper_fire_state(multiplier=multiplier)
    enc = urpe.FireBias(num_heads=3).double()
    enc.load_state_dict(porting.fire_from_paper(state))
    got = enc.bias(torch.zeros(1, 3, 12, 4, **F64), SEQ(12), 1.0)[0]
    # The paper's |i - j| is symmetric; urpe's side input has a zero weight after conversion.
    report(f"FIRE vs paper (L multiplier {multiplier})", got, paper_fire(state, 12))


def test_fire_from_paper_refuses_c_zero_and_missing_keys():
    state = random_paper_fire_state(c=0.0)
    with pytest.raises(ValueError, match="c is 0"):
        porting.fire_from_paper(state)
    with pytest.raises(KeyError, match="init_L"):
        porting.fire_from_paper({"c": torch.tensor(1.0)})


# ---------------------------------------------------------------------- official URPE (fairseq)
def official_urpe_buckets(max_seq_len, num_buckets, max_distance):
    """lsj2408/URPE `TransformerSentenceEncoder`: bucket index of every (i, j) pair."""
    i = torch.arange(max_seq_len)[:, None]
    j = torch.arange(max_seq_len)[None, :]
    rel = j - i
    sign = torch.sign(rel)
    half = num_buckets // 2
    n = rel.abs()
    max_exact = half // 2
    large = max_exact + (
        torch.log(n.float() / max_exact) / math.log(max_distance / max_exact) * (half - max_exact)
    ).to(torch.long)
    large = torch.min(large, torch.full_like(large, half - 1))
    bucket = torch.where(n < max_exact, n, large) * sign
    bucket[bucket >= 0] += 2
    return bucket - bucket.min()


@pytest.mark.parametrize("max_seq_len", [1, 9, 64, 129, 300])
def test_official_urpe_bucketed_tables_convert(max_seq_len):
    heads, num_buckets, max_distance = 3, 64, 128
    weight = torch.randn(num_buckets + 1, heads, **F64)  # nn.Embedding(rp_bucket + 1, H)
    table = porting.urpe_official_table(
        weight, max_seq_len, num_buckets=num_buckets, max_distance=max_distance
    )
    bias = urpe.T5Bias(heads, num_buckets, max_distance, bidirectional=True).double()
    gate = urpe.ToeplitzGate(heads, num_buckets=num_buckets, bucket_max_distance=max_distance)
    gate = gate.double()
    with torch.no_grad():
        bias.table.copy_(table)
        gate.table.copy_(table)
    buckets = official_urpe_buckets(max_seq_len, num_buckets, max_distance)
    for length in sorted({1, max_seq_len // 2 + 1, max_seq_len}):
        want = weight[buckets[:length, :length]].permute(2, 0, 1)  # (H, L, L)
        got = dense(
            bias.bias(torch.zeros(1, heads, length, 4, **F64), SEQ(length), 1.0), length, length
        )
        assert torch.equal(got[0], want)
        assert torch.equal(gate(SEQ(length)).dense(length, length)[0], want)


def test_official_urpe_unique_tables_convert():
    heads, max_seq_len = 2, 7
    weight = torch.randn(2 * max_seq_len - 1, heads, **F64)
    table = porting.urpe_official_table(weight, max_seq_len)
    bias = urpe.RelativeBias(heads, max_seq_len - 1).double()
    with torch.no_grad():
        bias.table.copy_(table)
    i, j = torch.arange(max_seq_len)[:, None], torch.arange(max_seq_len)[None, :]
    want = weight[(j - i) - (j - i).min()].permute(2, 0, 1)  # the official "unique" mode
    got = bias.bias(torch.zeros(1, heads, max_seq_len, 4, **F64), SEQ(max_seq_len), 1.0)
    assert torch.equal(dense(got, max_seq_len, max_seq_len)[0], want)
    with pytest.raises(ValueError, match="13 rows"):
        porting.urpe_official_table(weight[:5], max_seq_len)
    with pytest.raises(ValueError, match="65 rows"):
        porting.urpe_official_table(weight, max_seq_len, num_buckets=64)


# ------------------------------------------------------------------------------ Transformer-XL
def official_transformer_xl(w, x, memory, num_heads):
    """kimiyoung/transformer-xl `RelPartialLearnableMultiHeadAttn` (post-attention part only:
    no dropout, residual or LayerNorm), written with its relative shift."""
    qlen, klen = x.shape[0], x.shape[0] + memory.shape[0]
    cat = torch.cat([memory, x], 0)  # (klen, B, E)
    heads = cat @ w["qkv_net.weight"].T
    q, k, v = heads.chunk(3, dim=-1)
    q = q[-qlen:].reshape(qlen, x.shape[1], num_heads, -1)
    k = k.reshape(klen, x.shape[1], num_heads, -1)
    v = v.reshape(klen, x.shape[1], num_heads, -1)
    d_head = q.shape[-1]
    dim = x.shape[-1]
    pos_seq = torch.arange(klen - 1, -1, -1.0, **F64)
    inv_freq = 1 / (10000 ** (torch.arange(0.0, dim, 2.0, **F64) / dim))
    sinusoid = pos_seq[:, None] * inv_freq[None, :]
    r = torch.cat([sinusoid.sin(), sinusoid.cos()], -1)  # (klen, E)
    r_head = (r @ w["r_net.weight"].T).reshape(klen, num_heads, d_head)
    ac = torch.einsum("ibnd,jbnd->ijbn", q + w["r_w_bias"], k)
    bd = torch.einsum("ibnd,jnd->ijbn", q + w["r_r_bias"], r_head)
    # _rel_shift: pad one zero column, reshape, drop the first row.
    pad = torch.zeros((bd.size(0), 1, *bd.size()[2:]), **F64)
    bd = torch.cat([pad, bd], 1).view(bd.size(1) + 1, bd.size(0), *bd.size()[2:])[1:].view_as(bd)
    score = (ac + bd) / math.sqrt(d_head)
    mask = torch.triu(torch.ones(qlen, klen, dtype=torch.bool), diagonal=1 + memory.shape[0])
    score = score.masked_fill(mask[:, :, None, None], -float("inf"))
    prob = torch.softmax(score, dim=1)
    vec = torch.einsum("ijbn,jbnd->ibnd", prob, v).reshape(qlen, x.shape[1], -1)
    return vec @ w["o_net.weight"].T  # (qlen, B, E)


def test_transformer_xl_from_official_gives_the_official_attention():
    heads, d_head, qlen, mlen, batch = 2, 3, 5, 4, 2
    dim = heads * d_head
    g = torch.Generator().manual_seed(1)
    w = {
        "qkv_net.weight": torch.randn(3 * dim, dim, generator=g, **F64) * 0.5,
        "o_net.weight": torch.randn(dim, dim, generator=g, **F64) * 0.5,
        "r_net.weight": torch.randn(dim, dim, generator=g, **F64) * 0.5,
        "r_w_bias": torch.randn(heads, d_head, generator=g, **F64),
        "r_r_bias": torch.randn(heads, d_head, generator=g, **F64),
    }
    x = torch.randn(qlen, batch, dim, generator=g, **F64)
    memory = torch.randn(mlen, batch, dim, generator=g, **F64)
    want = official_transformer_xl(w, x, memory, heads).transpose(0, 1)  # (B, qlen, E)
    position = urpe.TransformerXLRelative(dim, heads, d_head)
    mha = urpe.MultiheadAttention(dim, heads, position=position, backend="reference").double()
    mha.load_state_dict(porting.transformer_xl_from_official(w, heads))
    got = mha(x.transpose(0, 1), memory=memory.transpose(0, 1), is_causal=True)
    report("Transformer-XL attention vs official", got, want)
    with pytest.raises(ValueError, match="n_head \\* d_head = d_model"):
        porting.transformer_xl_from_official(
            {**w, "r_w_bias": torch.zeros(heads, d_head + 1)}, heads
        )


# ---------------------------------------------------------------------------------- Graphormer
def test_graphormer_spatial_and_hop_tables_convert():
    from torch_geometric.data import Batch

    from urpe.data.molecules import smiles_to_graph
    from urpe.graph import ShortestPaths, SpatialBias, relation_index, to_dense_graph_batch

    from .graph_reference import SMILES

    heads, max_distance = 3, 12  # 12 >= every distance in these molecules
    spatial_pos = torch.randn(512, heads, **F64)  # nn.Embedding(num_spatial, H, padding_idx=0)
    virtual = torch.randn(1, heads, **F64)
    spatial = SpatialBias(heads, max_distance + 4).double()
    with torch.no_grad():
        spatial.table.copy_(porting.graphormer_spatial_table(spatial_pos, virtual, max_distance))
    graphs = [ShortestPaths()(smiles_to_graph(s, "rdkit")[0]) for s in SMILES]
    batch = to_dense_graph_batch(Batch.from_data_list(graphs))
    got = spatial(relation_index(batch.spd, max_distance))  # (B, H, N+1, N+1)
    for b, data in enumerate(graphs):
        n = data.num_nodes
        spd = batch.spd[b, :n, :n]
        index = torch.where(spd < 0, 510, spd) + 1  # Graphormer: unreachable 510, then + 1
        want = torch.empty(heads, n + 1, n + 1, **F64)
        want[:, 1:, 1:] = spatial_pos[index].permute(2, 0, 1)
        want[:, 0, :] = want[:, :, 0] = virtual[0][:, None]
        assert torch.equal(got[b, :, : n + 1, : n + 1], want)
    edge_dis = torch.randn(128 * heads * heads, 1, **F64)
    hops = porting.graphormer_hop_weights(edge_dis, heads, 5)
    bmm_view = edge_dis.reshape(-1, heads, heads)[:5]  # Graphormer's own reshape for its bmm
    assert torch.equal(hops, bmm_view)
    with pytest.raises(ValueError, match="reads rows up to"):
        porting.graphormer_spatial_table(spatial_pos[:10], virtual, max_distance)
