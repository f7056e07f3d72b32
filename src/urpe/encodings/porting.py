"""Converters from other implementations' parameters to urpe's, for loading their checkpoints.

Each function takes the original's tensors under the original's names and returns a state dict
for the urpe module named in its docstring (`module.load_state_dict(...)`). What each encoding
matches and where it differs is in docs/porting.md; the tests in tests/test_porting.py convert
original-format weights and check that the outputs agree.

Torch only: no original package is imported here.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from .bias import KerpleBias
from .buckets import t5_buckets


def kerple_from_official(
    kind: str, bias_p: Tensor, bias_a: Tensor, eps: float = 1e-2
) -> dict[str, Tensor]:
    """`KerpleBias` parameters from the official KERPLE code (`ParallelKerpleLog`,
    `ParallelKerplePower` with `bias_p` and `bias_a`, each (H, 1, 1) or (H,)).

    log:   -p log(1 + a d)   ->  r1 = bias_p, r2 = bias_a
    power: -a d^p            ->  r1 = bias_a, r2 = bias_p (the exponent)

    The official code clamps p and a to >= eps (and the exponent to <= 2) on every forward; the
    clamped values are what is converted. A value exactly on a bound maps to a raw parameter
    1e-14 inside it (urpe's bounds are open except r2 = 2), whose value rounds to the bound.
    """
    if kind not in ("log", "power"):
        raise ValueError(f"kind must be 'log' or 'power', got {kind!r}")
    p, a = bias_p.detach().reshape(-1), bias_a.detach().reshape(-1)
    if p.shape != a.shape:
        raise ValueError(f"bias_p and bias_a must have one value per head: {p.shape} vs {a.shape}")
    r1, r2 = (p, a) if kind == "log" else (a, p)
    module = KerpleBias(r1.numel(), kind, eps)
    return {"raw_r1": module.raw_from(r1, "r1"), "raw_r2": module.raw_from(r2, "r2")}


def fire_from_paper(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """`FireBias` parameters from the FIRE paper's reference module (Li et al. 2024, appendix):
    keys `c`, `init_L`, `L_multiplier`, `mlp.0.weight` (hidden, 1), `mlp.0.bias`,
    `mlp.2.weight`, `mlp.2.bias`.

    c -> log_c = log |c| (the paper uses |c|); L = |L_multiplier * init_L| -> threshold; the
    first MLP layer gains a zero column for urpe's side input, so a bidirectional model gives
    the paper's symmetric f(|i - j|) and a causal one is unchanged. Build the module with the
    paper's hidden width and eps (urpe's defaults, 32 and 1e-6).
    """
    missing = {"c", "init_L", "L_multiplier", "mlp.0.weight"} - set(state)
    if missing:
        raise KeyError(f"the FIRE state lacks {sorted(missing)}")
    c = state["c"].detach().abs()
    if not bool(c > 0):
        raise ValueError("FIRE's c is 0: every distance then maps to 0, and log c is -inf")
    first = state["mlp.0.weight"].detach()  # (hidden, 1)
    out = {
        "log_c": c.log(),
        "threshold": (state["L_multiplier"] * state["init_L"]).detach().abs(),
        "mlp.0.weight": torch.cat([first, torch.zeros_like(first)], dim=1),  # (hidden, 2)
    }
    for name in ("mlp.0.bias", "mlp.2.weight", "mlp.2.bias"):
        out[name] = state[name].detach()
    return out


def _official_urpe_rows(offsets: Tensor, max_seq_len: int, num_buckets: int, max_distance: int):
    """Row of the official URPE bucketed table for each offset j - i (|j - i| < max_seq_len).

    The official code buckets |j - i| like T5, multiplies by the sign, adds 2 to the offsets
    >= 0, then subtracts the smallest value over a max_seq_len x max_seq_len grid: the rows
    shift with max_seq_len, and the two rows between "before" and "diagonal" are never read.
    """
    # |d| bucketed as T5 does for keys before the query (its lower half: no direction bit).
    magnitude = t5_buckets(-offsets.abs(), num_buckets, max_distance, bidirectional=True)
    value = torch.where(offsets < 0, -magnitude, magnitude + 2)  # (..,)
    far = torch.tensor([-(max_seq_len - 1)])
    lowest = (
        -t5_buckets(far, num_buckets, max_distance, bidirectional=True) if max_seq_len > 1 else 2
    )
    return value - int(lowest)


def urpe_official_table(
    weight: Tensor,
    max_seq_len: int,
    *,
    num_buckets: int | None = None,
    max_distance: int = 128,
) -> Tensor:
    """An (H, width) table for `RelativeBias`, `ToeplitzGate` or `T5Bias` from the official
    URPE code's `rp_bias.weight` or `ur_rp_bias.weight` (an `nn.Embedding(rows, H)` weight).

    Unique mode (num_buckets None; the released scripts): rows are offsets -(L-1)..L-1 in order,
    so the table is the transpose, for `RelativeBias(H, max_distance=L-1)` or
    `ToeplitzGate(H, L-1)` with L = the official `--max-seq-len`.

    Bucketed mode (`--rp-bucket`/`--ur-rp-bucket` = num_buckets, `--max-rp` = max_distance):
    the official rows are renumbered to urpe's T5 columns (see `_official_urpe_rows`), for
    `T5Bias(H, num_buckets, max_distance, bidirectional=True)` or
    `ToeplitzGate(H, num_buckets=..., bucket_max_distance=...)`. Columns for distances the
    official model never saw (beyond max_seq_len - 1) take the farthest seen row: urpe clips
    where the official model cannot run at all.
    """
    weight = weight.detach()
    if max_seq_len < 1:
        raise ValueError(f"max_seq_len must be >= 1, got {max_seq_len}")
    if num_buckets is None:
        if weight.shape[0] != 2 * max_seq_len - 1:
            raise ValueError(
                f"a unique-mode table for max_seq_len={max_seq_len} has {2 * max_seq_len - 1} "
                f"rows, got {weight.shape[0]}"
            )
        return weight.t().contiguous()  # (H, 2L-1): column d + L - 1 for offset d
    if weight.shape[0] != num_buckets + 1:
        raise ValueError(
            f"a bucketed table with num_buckets={num_buckets} has {num_buckets + 1} rows, "
            f"got {weight.shape[0]}"
        )
    reach = max(max_distance, max_seq_len) + 1  # every urpe column appears within this range
    offsets = torch.arange(-reach, reach + 1)
    seen = offsets.clamp(-(max_seq_len - 1), max_seq_len - 1)
    rows = _official_urpe_rows(seen, max_seq_len, num_buckets, max_distance)
    columns = t5_buckets(offsets, num_buckets, max_distance, bidirectional=True)
    zero = torch.zeros(1, dtype=torch.long)
    diagonal = _official_urpe_rows(zero, max_seq_len, num_buckets, max_distance)
    table = weight[int(diagonal)].unsqueeze(-1).repeat(1, num_buckets)  # (H, num_buckets)
    # The one column no offset reaches ("after the query, distance 0") keeps the diagonal's row.
    table[:, columns] = weight[rows].t()
    return table


def t5_table(relative_attention_bias: Tensor) -> Tensor:
    """`T5Bias.table` (H, num_buckets) from a Hugging Face T5 layer's
    `relative_attention_bias.weight` (num_buckets, H). Build `T5Bias(H, num_buckets,
    max_distance, bidirectional=is_encoder)` from the T5 config and run attention with
    scale=1.0 (T5 folds the 1/sqrt(d) into its initialisation)."""
    return relative_attention_bias.detach().t().contiguous()


def transformer_xl_from_official(
    state: Mapping[str, Tensor], num_heads: int, prefix: str = ""
) -> dict[str, Tensor]:
    """A `MultiheadAttention(dim, H, position=TransformerXLRelative(dim, H, D))` state dict from
    the official Transformer-XL `RelPartialLearnableMultiHeadAttn`: keys `qkv_net.weight`
    (3 H D, dim), `o_net.weight` (dim, H D), `r_net.weight` (H D, dim), `r_w_bias` and
    `r_r_bias` (H, D) (in the official model these two usually live on the whole model, shared
    by all layers: pass them in `state` as well).

    The official projections have no bias: the returned state sets urpe's to zero. urpe needs
    dim = H * D. Give every layer its own projections with `share_position=False` in a
    `TransformerConfig` (its default shares W_R, u and v across layers, as the official
    `untie_r=False` shares u and v but not W_R).
    """
    qkv = state[prefix + "qkv_net.weight"].detach()
    out_w = state[prefix + "o_net.weight"].detach()
    r_net = state[prefix + "r_net.weight"].detach()
    u, v = state[prefix + "r_w_bias"].detach(), state[prefix + "r_r_bias"].detach()
    dim = qkv.shape[1]
    if qkv.shape[0] != 3 * dim or u.numel() != dim or u.shape[0] != num_heads:
        raise ValueError(
            f"urpe's MultiheadAttention needs n_head * d_head = d_model: qkv_net.weight is "
            f"{tuple(qkv.shape)}, r_w_bias {tuple(u.shape)}, num_heads={num_heads}"
        )
    q, k, val = qkv.chunk(3, dim=0)
    zeros = qkv.new_zeros(dim)
    return {
        "q_proj.weight": q,
        "q_proj.bias": zeros,
        "k_proj.weight": k,
        "k_proj.bias": zeros.clone(),
        "v_proj.weight": val,
        "v_proj.bias": zeros.clone(),
        "out_proj.weight": out_w,
        "out_proj.bias": zeros.clone(),
        "position.project.weight": r_net,
        "position.content_bias": u.reshape(num_heads, 1, -1),
        "position.position_bias": v.reshape(num_heads, 1, -1),
    }


def graphormer_spatial_table(
    spatial_pos_weight: Tensor, virtual_distance_weight: Tensor, max_distance: int
) -> Tensor:
    """`urpe.graph.SpatialBias.table` (H, D + 4) from Graphormer's `spatial_pos_encoder.weight`
    (num_spatial, H; row d + 1 for distance d, row 0 padding, row 511 unreachable) and
    `graph_token_virtual_distance.weight` (1, H), for `GraphEncodingConfig(max_distance=D)`.

    Columns: d = 0..D, then "farther than D" (takes Graphormer's row for D + 1, so choose D at
    least the largest distance in your graphs minus one for exact outputs; Graphormer instead
    masks pairs beyond its `spatial_pos_max`), unreachable, and the graph token's distance.
    """
    weight = spatial_pos_weight.detach()
    if weight.shape[0] < max_distance + 3:
        raise ValueError(
            f"spatial_pos_encoder has {weight.shape[0]} rows; max_distance={max_distance} "
            f"reads rows up to {max_distance + 2}"
        )
    unreachable = weight[min(511, weight.shape[0] - 1)]
    virtual = virtual_distance_weight.detach().reshape(-1)
    rows = [weight[1 : max_distance + 3], unreachable[None], virtual[None]]
    return torch.cat(rows).t().contiguous()  # (H, D + 4)


def graphormer_hop_weights(edge_dis_weight: Tensor, num_heads: int, max_hops: int) -> Tensor:
    """`urpe.graph.EdgePathBias.hop_weights` (K, H, H) from Graphormer's
    `edge_dis_encoder.weight` (128 H H, 1), of which Graphormer reads the first K matrices
    (K = its `multi_hop_max_dist`)."""
    matrices = edge_dis_weight.detach().reshape(-1, num_heads, num_heads)
    if matrices.shape[0] < max_hops:
        raise ValueError(f"edge_dis_encoder holds {matrices.shape[0]} hops, not {max_hops}")
    return matrices[:max_hops].clone()
