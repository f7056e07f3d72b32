"""The Triton URPE kernel in three layers: raw ops, autograd, public function.

1. Raw ops `urpe::triton_attention_forward` / `urpe::triton_attention_backward`
   (`torch.library.custom_op`, with fake implementations so `torch.compile` traces through them):
   tensors and scalars only, in the blockwise backend's signature. A bias or gate arrives as
   (tensor, index, kind), kind one of "none", "toeplitz", "relation", "dense"; the attn_mask is
   boolean (a float one is added to the bias first, in layer 3). Their vmap rules fold a vmapped
   dim into the batch, or loop where folding would be wrong (`urpe.kernels.composable`).
2. Autograd: `TritonAttention`, the autograd.Function with `setup_context` shared with the blockwise
   backend, so `torch.func.grad`, `vmap`, `functional_call` and `torch.compile(fullgraph=True)`
   compose with the kernel.
3. `triton_run(spec)`, the backend, and `triton_attention`, the documented function with
   `urpe.attention`'s arguments.

Block sizes. On CUDA the launches are autotuned (`launch.py`: the configurations, pruned per
head dim and dtype to those `compile_kernels.py` found free of spills). The tuning key is (next
power of two of Lq, of Lk, head dim, value dim, normalisation, causal, padding, a boolean
attn_mask, dropout, the kinds of bias and gate and of their gradients) plus the dtype of every
tensor argument (Triton adds those itself): a new length bucket, head size, dtype or variant is
tuned once, and later calls with the same key reuse the winner (`cache_results=True` keeps it on
disk beside the compiled kernels). Lengths reach the compiler only through Triton's own
specialisation (divisible by 16 or not, or 1), so a new length never recompiles. The dQ kernel
zeroes its atomic accumulators between trials (`reset_to_zero`). Under the interpreter, or when
`block_q`/`block_k` are given, one fixed configuration runs instead.

Table gradients are NOT bitwise deterministic by default on a GPU: each tile reduces its
contribution in registers (BLOCK_M + BLOCK_N - 1 anti-diagonal sums for a Toeplitz table, a
Relation tile entry by entry) and adds it to the float32 table gradient with `tl.atomic_add`,
whose order varies between runs (results differ by float32 rounding only). Under
`torch.use_deterministic_algorithms(True)` the dQ kernel instead writes the table term's dense
(B, H, Lq, Lk) float32 gradient, each entry once, and torch reduces it to the table with
`index_add_` (deterministic in that mode): bitwise reproducible, at O(B H Lq Lk) memory for the
backward pass. dQ, dK, dV and dense-term gradients are written once per entry and are always
deterministic.
"""

from __future__ import annotations

import warnings

import torch
import triton
from torch import Tensor

from ..composable import define_attention_ops
from ..dtypes import compute_dtype
from ..layout import BackwardArgs, ForwardArgs
from ..reference import draw_seed
from ..spec import AttentionSpec, resolve
from ..terms import Dense, dense_term
from . import kernels as K
from .launch import Launch, fixed_blocks, interpreting, run_launch
from .support import refusal
from .term_grads import buffer_kind, term_grad_buffer, term_grad_result

NORMALIZATION_CODES = {"softmax": K.SOFTMAX.value, "exp": K.EXP.value, "l2": K.L2.value,
                       "relu2": K.RELU2.value}  # fmt: skip


# --------------------------------------------------------------------------------------------
# Launch helpers


def _compile_flags(q: Tensor) -> dict:
    """Constexpr flags that depend on dtype and device only."""
    if q.dtype == torch.float64:
        precision = "ieee"
    elif q.dtype == torch.float32:
        # follow torch's own switch for float32 matrix products (off by default: exact float32)
        precision = "tf32" if torch.backends.cuda.matmul.allow_tf32 and q.is_cuda else "ieee"
    else:
        precision = None
    return dict(
        ACC=triton.language.float64 if q.dtype == torch.float64 else triton.language.float32,
        PRECISION=precision,
        UPCAST=interpreting() and q.dtype == torch.bfloat16,
        BLOCK_D=max(16, triton.next_power_of_2(q.shape[-1])),
    )


def _dummy(q: Tensor, dtype=None) -> Tensor:
    return torch.empty(1, device=q.device, dtype=q.dtype if dtype is None else dtype)


def _pad_bytes(q: Tensor, k: Tensor, key_padding_mask: Tensor | None) -> Tensor:
    """The padding mask (B|1, Lk) as contiguous (B, Lk) bytes (the kernels index b * Lk + j)."""
    if key_padding_mask is None:
        return _dummy(q, torch.uint8)
    return key_padding_mask.expand(q.shape[0], k.shape[2]).contiguous().view(torch.uint8)


def _document_spans(
    q: Tensor, k: Tensor, document_ids: Tensor | None, key_padding_mask: Tensor | None
) -> Tensor:
    """Documents and key padding as the kernels read them: (B, 5, Lk) int32, O(L) memory (never
    an (Lq, Lk) mask) and O(L log L) time (one sort), nothing read on the host. Row 0: the
    first key of each key's document (two keys share a document exactly when these agree: the
    kernels compare them); row 1: the least first key of the documents of keys j.. (a running
    minimum from the end); row 2: the greatest last key of the documents of keys ..j (a running
    maximum). A block of positions a..e needs only keys row1[a]..row2[e]: exact for packed,
    sorted ids. Rows 3 and 4: the first unpadded key from j on (Lk if none) and the last one up
    to j (-1 if none): the keys a block walks lie between them (`tiles.unpadded_keys`)."""
    b, lk = q.shape[0], k.shape[2]
    if document_ids is None and key_padding_mask is None:
        return _dummy(q, torch.int32)
    keys = torch.arange(lk, device=q.device).expand(b, lk)
    if document_ids is None:  # (rows 0-2 are read only with documents)
        first = lower = upper = keys
    else:
        ids = document_ids.expand(b, lk).contiguous()
        ordered, order = torch.sort(ids, dim=-1, stable=True)  # a document's keys in key order
        first = order.gather(-1, torch.searchsorted(ordered, ids))
        last = order.gather(-1, torch.searchsorted(ordered, ids, right=True) - 1)
        lower = first.flip(-1).cummin(-1).values.flip(-1)
        upper = last.cummax(-1).values
    if key_padding_mask is None:  # (rows 3 and 4 are read only with key padding)
        after = before = keys
    else:
        padded = key_padding_mask.expand(b, lk)
        after = torch.where(padded, lk, keys).flip(-1).cummin(-1).values.flip(-1)
        before = torch.where(padded, -1, keys).cummax(-1).values
    return torch.stack([first, lower, upper, after, before], 1).to(torch.int32)


def _mask_args(q: Tensor, k: Tensor, attn_mask: Tensor | None) -> tuple:
    """Kernel arguments (ptr, s_b, s_h, s_i, s_j) of a boolean attn_mask (B|1, H|1, Lq|1, Lk|1),
    read as bytes through its strides (stride 0 where it broadcasts: nothing is copied)."""
    if attn_mask is None:
        return (_dummy(q, torch.uint8), 0, 0, 0, 0)
    if attn_mask.dtype != torch.bool:
        raise ValueError(
            "the Triton ops take a boolean attn_mask only; a float one is added to the bias "
            "before them (see `triton_run`)"
        )
    mask = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))
    mask = mask.expand(*q.shape[:3], k.shape[2]).view(torch.uint8)  # (B, H, Lq, Lk) view
    return (mask, *mask.stride())


def _term_args(q: Tensor, k: Tensor, term: Tensor | None, index: Tensor | None, kind: int):
    """Kernel arguments (ptr, idx, s_b, s_h, s_i, s_j, K) of a bias or gate."""
    b, h, lq = q.shape[:3]
    lk = k.shape[2]
    if kind == K.NO_TERM.value:
        return (_dummy(q), _dummy(q, torch.int32), 0, 0, 0, 0, 0)
    if kind == K.TOEPLITZ.value:
        table = term.contiguous()
        s_h = 0 if table.shape[0] == 1 else table.stride(0)
        return (table, _dummy(q, torch.int32), 0, s_h, 0, 0, (table.shape[1] - 1) // 2)
    if kind == K.DECAY.value:  # c = cumsum(log_forget) (B|1, H|1, Lk), once, in O(L)
        c = term.to(compute_dtype(q.dtype)).cumsum(-1).contiguous()
        s_b = 0 if c.shape[0] == 1 else c.stride(0)
        s_h = 0 if c.shape[1] == 1 else c.stride(1)
        return (c, _dummy(q, torch.int32), s_b, s_h, 0, 0, 0)
    if kind == K.RELATION.value:
        table = term.contiguous()
        s_h = 0 if table.shape[0] == 1 else table.stride(0)
        idx = index.expand(b, lq, lk)  # stride 0 where one index serves the whole batch
        return (table, idx, idx.stride(0), s_h, idx.stride(1), idx.stride(2), 0)
    dense = term.reshape((1,) * (4 - term.dim()) + tuple(term.shape)).expand(b, h, lq, lk)
    return (dense, _dummy(q, torch.int32), *dense.stride(), 0)


def _common_args(q: Tensor, k: Tensor, v: Tensor) -> tuple:
    b, h, lq, d = q.shape
    hk, lk, dv = k.shape[1], k.shape[2], v.shape[3]
    return (*q.stride(), *k.stride(), *v.stride(), h, h // hk, lq, lk, d, dv)


def _buckets(q: Tensor, k: Tensor) -> tuple[int, int]:
    return triton.next_power_of_2(q.shape[2]), triton.next_power_of_2(k.shape[2])


# --------------------------------------------------------------------------------------------
# Layer 1: the raw ops' bodies, on the argument layout every such kernel shares
# (`urpe.kernels.layout`): `define_attention_ops` registers them with the vmap rules and the
# autograd Function of the blockwise backend.

KIND_CODES = {"none": K.NO_TERM.value, "toeplitz": K.TOEPLITZ.value, "relation": K.RELATION.value,
              "dense": K.DENSE.value, "decay": K.DECAY.value}  # fmt: skip
GATE_KINDS = ("none", "toeplitz", "relation", "dense")  # a Decay is a bias only


def _launch_meta(args: ForwardArgs, kinds: tuple[int, int]) -> dict:
    """The constexpr arguments shared by the three kernels."""
    return dict(
        B_KIND=kinds[0],
        C_KIND=kinds[1],
        NORM=NORMALIZATION_CODES[args.normalization],
        CAUSAL=args.is_causal,
        HAS_PAD=args.key_padding_mask is not None,
        HAS_MASK=args.attn_mask is not None,
        DOCS=args.document_ids is not None,
        DROPOUT=args.dropout_p > 0.0,
        BLOCK_DV=max(16, triton.next_power_of_2(args.v.shape[-1])),
        **_compile_flags(args.q),
    )


def _seed_tensor(seed: Tensor | None, device: torch.device) -> Tensor:
    """The seed as the kernels read it: an int64 tensor of one element on q's device (the
    kernels load it: the host never reads it, so a launch never waits for the device)."""
    if seed is None:  # no dropout: never loaded
        return torch.zeros(1, dtype=torch.int64, device=device)
    return seed.to(device=device, dtype=torch.int64).reshape(1)


def forward_launch(args: ForwardArgs) -> tuple[Launch, Tensor, Tensor]:
    """The forward kernel's call for these arguments, and its outputs (written by the launch):
    out (B, H, Lq, Dv) in q's dtype and the row statistic (B, H, Lq) the backward needs
    (softmax: log-sum-exp; l2: m + log(sum e^2(s-m))/2; relu2: visible key count).

    The attn_mask is None or boolean here (a float one is added to the bias in layer 3).
    """
    q, k, v = args.q, args.k, args.v
    b, h, lq, _ = q.shape
    out = torch.empty(b, h, lq, v.shape[-1], device=q.device, dtype=q.dtype)
    stat = torch.empty(b, h, lq, device=q.device, dtype=compute_dtype(q.dtype))
    kinds = (KIND_CODES[args.bias_kind], KIND_CODES[args.gate_kind])
    spans = _document_spans(q, k, args.document_ids, args.key_padding_mask)
    launch = (
        q, k, v, out, stat, _pad_bytes(q, k, args.key_padding_mask),
        *_mask_args(q, k, args.attn_mask), spans,
        *_term_args(q, k, args.bias, args.bias_index, kinds[0]),
        *_term_args(q, k, args.gate, args.gate_index, kinds[1]),
        *_common_args(q, k, v), args.scale, args.dropout_p,
        _seed_tensor(args.dropout_seed, q.device), 0,
        *_buckets(q, k),
    )  # fmt: skip
    return Launch("forward", launch, _launch_meta(args, kinds), lq, b * h), out, stat


def _forward(args: ForwardArgs) -> tuple[Tensor, Tensor]:
    """`forward_launch`, launched: (out, row statistic)."""
    launch, out, stat = forward_launch(args)
    run_launch(launch, fixed_blocks(args.block_q, args.block_k))
    return out, stat


def _forward_fake(args: ForwardArgs):
    b, h, lq, _ = args.q.shape
    out = args.q.new_empty(b, h, lq, args.v.shape[-1])
    return out, args.q.new_empty(b, h, lq, dtype=compute_dtype(args.q.dtype))


def backward_launches(grads: BackwardArgs) -> tuple[Launch, Launch, tuple]:
    """The dK/dV and dQ kernels' calls for these arguments, and the gradients they produce
    (dq, dk, dv, d bias buffer, d gate buffer): see `_backward`."""
    args = grads.forward
    q, k, v = args.q, args.k, args.v
    b, h, lq, d = q.shape
    hk, lk, dv = k.shape[1], k.shape[2], v.shape[3]
    acc = compute_dtype(q.dtype)
    kinds = (KIND_CODES[args.bias_kind], KIND_CODES[args.gate_kind])
    bias_grad = buffer_kind(kinds[0], grads.needs_bias)
    gate_grad = buffer_kind(kinds[1], grads.needs_gate)
    grad_out = grads.grad_out.contiguous()
    if NORMALIZATION_CODES[args.normalization] in (K.SOFTMAX.value, K.L2.value):
        delta = (grad_out.to(acc) * grads.out.to(acc)).sum(-1)  # delta_i = dO_i . O_i
    else:
        delta = _dummy(q, acc)
    dq = torch.empty(b, h, lq, d, device=q.device, dtype=q.dtype)
    dk = torch.empty(b, hk, lk, d, device=q.device, dtype=k.dtype)
    dv_ = torch.empty(b, hk, lk, dv, device=q.device, dtype=v.dtype)
    masks = (_pad_bytes(q, k, args.key_padding_mask), *_mask_args(q, k, args.attn_mask),
             _document_spans(q, k, args.document_ids, args.key_padding_mask))  # fmt: skip
    bias_args = _term_args(q, k, args.bias, args.bias_index, kinds[0])
    gate_args = _term_args(q, k, args.gate, args.gate_index, kinds[1])
    d_bias, d_bias_sh = term_grad_buffer(q, k, args.bias, bias_grad)
    d_gate, d_gate_sh = term_grad_buffer(q, k, args.gate, gate_grad)
    common = (*_common_args(q, k, v), args.scale, args.dropout_p,
              _seed_tensor(args.dropout_seed, q.device), 0, *_buckets(q, k))  # fmt: skip
    meta = _launch_meta(args, kinds)
    # the keys' share of a Decay's d c (the dK/dV kernel's; the queries' is the dQ kernel's)
    kv_grad = bias_grad if bias_grad == K.DECAY.value else K.NO_TERM.value
    d_keys = (torch.empty(b, h, lk, device=q.device, dtype=acc) if kv_grad == K.DECAY.value
              else _dummy(q, acc))  # fmt: skip
    kv_args = (q, k, v, grad_out, grads.stat, delta, dk, dv_, *masks, *bias_args, d_keys,
               *gate_args, *common)  # fmt: skip
    q_args = (
        q, k, v, grad_out, grads.stat, delta, dq, *masks,
        *bias_args, d_bias, d_bias_sh, *gate_args, d_gate, d_gate_sh, *common,
    )  # fmt: skip
    kv = Launch("backward_kv", kv_args, dict(meta, B_GRAD=kv_grad), lk, b * hk)
    q_launch = Launch("backward_q", q_args, dict(meta, B_GRAD=bias_grad, C_GRAD=gate_grad), lq,
                      b * h)  # fmt: skip
    if bias_grad == K.DECAY.value:
        d_bias = (d_bias, d_keys)
    return kv, q_launch, (dq, dk, dv_, d_bias, d_gate)


def _backward(grads: BackwardArgs) -> tuple:
    """Gradients (dq, dk, dv, d bias, d gate, None): a term's gradient has the term tensor's
    shape, None where not asked for. The attn_mask is boolean here (a float one was added to the
    bias), so it has no gradient."""
    args = grads.forward
    kv, q_launch, (dq, dk, dv, d_bias, d_gate) = backward_launches(grads)
    blocks = fixed_blocks(args.block_q, args.block_k)
    run_launch(kv, blocks)
    run_launch(q_launch, blocks)
    return (
        dq,
        dk,
        dv,
        term_grad_result(d_bias, args, "bias", q_launch.meta["B_GRAD"]),
        term_grad_result(d_gate, args, "gate", q_launch.meta["C_GRAD"]),
        None,
    )


# --------------------------------------------------------------------------------------------
# Layer 2: autograd (shared with the blockwise backend)

TRITON = define_attention_ops("triton_attention", _forward, _backward, _forward_fake)
TritonAttention = TRITON.function


# --------------------------------------------------------------------------------------------
# Layer 3: the backend and the public function


def _bias_with_float_mask(spec: AttentionSpec):
    """(bias, attn_mask) as the ops take them: a float attn_mask is added to the bias, which is
    then dense (a Toeplitz or Relation bias is expanded, only in this case); a bool one stays a
    mask. Summed in the compute dtype, as the reference adds the two."""
    mask = spec.attn_mask
    if mask is None or mask.dtype == torch.bool:
        return spec.bias, mask
    dtype = spec.compute_dtype
    bias = dense_term(spec.bias, spec.lq, spec.lk)  # None or (B|1, H|1, Lq|1, Lk|1)
    mask = mask.to(dtype)
    return Dense(mask if bias is None else bias.to(dtype) + mask), None


def triton_run(spec: AttentionSpec, block_q: int = 0, block_k: int = 0) -> Tensor:
    """The Triton backend on a resolved call: (B, H, Lq, Dv) in q's dtype.

    block_q, block_k: fixed tile sizes (powers of two >= 16); 0 autotunes on CUDA (and uses 16
    under the interpreter).
    """
    bias, attn_mask = _bias_with_float_mask(spec)
    spec = spec.replace(bias=bias, attn_mask=attn_mask)
    if spec.dropout_p > 0.0 and spec.dropout_seed is None:
        spec = spec.replace(dropout_seed=draw_seed(spec.q.device))  # a tensor: no .item()
    return TRITON(ForwardArgs.from_spec(spec, block_q, block_k))


_RENAMED = {"seed": "dropout_seed", "block_m": "block_q", "block_n": "block_k"}


def triton_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    bias=None,
    gate=None,
    attn_mask: Tensor | None = None,
    key_padding_mask: Tensor | None = None,
    document_ids: Tensor | None = None,
    is_causal: bool = False,
    normalization: str = "softmax",
    scale: float | None = None,
    dropout_p: float = 0.0,
    dropout_seed: int | Tensor | None = None,
    block_q: int = 0,
    block_k: int = 0,
    **renamed,
) -> Tensor:
    """URPE attention on the Triton kernel: out = dropout(normalize(scale q k^T + B + M) * C) @ v.

    The kernel alone: unlike `urpe.attention(..., backend="triton")` it does not apply the
    non-finite rule or the `exp` overflow check around the call (what the GPU benchmark times).

    Args:
        q: (..., H, Lq, D). k: (..., Hkv, Lk, D), v: (..., Hkv, Lk, Dv), with H a multiple of Hkv
            (grouped-query attention: query head h reads key/value head h // (H / Hkv)).
        bias, gate: B and C as in `urpe.attention` (dense tensor, `Toeplitz` or `Relation`; the
            bias may be a `Decay`, computed per tile from cumsum(log_forget)).
        attn_mask: as in `urpe.attention`: bool (True takes part; read by the kernel per tile)
            or float (M, added to the bias, which is then expanded to a dense tensor).
        key_padding_mask: (..., Lk) bool, True marks a padded key.
        document_ids: (..., Lk) integer, packed documents: query i sees only keys of the
            document of key i + Lk - Lq (compared per tile; with packed, sorted ids the tiles
            outside a block's documents are skipped).
        is_causal: query i sees keys j <= i + Lk - Lq.
        normalization: "softmax", "exp", "l2" or "relu2".
        scale: logit scale, default 1 / sqrt(D).
        dropout_p: dropout on the gated weights; the mask comes from Philox(dropout_seed) and is
            regenerated in the backward pass, never stored.
        dropout_seed: an int or an int64 scalar tensor (default: drawn from torch's generator on
            q's device, so `torch.manual_seed` reproduces the masks).
        block_q, block_k: fixed tile sizes (powers of two >= 16); 0 autotunes on CUDA.
        The old names seed, block_m and block_n still work (deprecated).

    Returns:
        (..., H, Lq, Dv) in q's dtype. Half-precision inputs accumulate in float32.
    """
    given = dict(dropout_seed=dropout_seed, block_q=block_q, block_k=block_k)
    for old, value in renamed.items():
        if old not in _RENAMED:
            raise TypeError(f"triton_attention() got an unexpected keyword argument {old!r}")
        warnings.warn(
            f"triton_attention({old}=...) is deprecated; pass {_RENAMED[old]}=...",
            DeprecationWarning,
            stacklevel=2,
        )
        given[_RENAMED[old]] = value
    spec = resolve(
        q, k, v, bias=bias, gate=gate, attn_mask=attn_mask, key_padding_mask=key_padding_mask,
        document_ids=document_ids, is_causal=is_causal, normalization=normalization, scale=scale,
        dropout_p=dropout_p, dropout_seed=given["dropout_seed"], enable_gqa=True,
    )  # fmt: skip
    reason = refusal(spec)
    if reason is not None:
        raise ValueError(f"backend 'triton' cannot run this call: {reason}")
    for name in ("block_q", "block_k"):
        size = given[name]
        if size and (size < 16 or size & (size - 1)):
            raise ValueError(f"{name} must be 0 (autotune) or a power of two >= 16, got {size}")
    out = triton_run(spec, given["block_q"], given["block_k"])
    return out.reshape(*spec.batch_shape, spec.heads, spec.lq, spec.value_dim)


def dropout_keep_mask(
    batch: int, heads: int, lq: int, lk: int, dropout_p: float, seed: int, device
) -> Tensor:
    """The keep mask (B, H, Lq, Lk) bool that `triton_attention(..., dropout_p, seed=seed)`
    applies: for checking the kernel against a reference with the same mask."""
    keep = torch.empty(batch, heads, lq, lk, dtype=torch.bool, device=device)
    block = 16
    grid = (triton.cdiv(lq, block) * batch * heads, triton.cdiv(lk, block))
    seed = torch.as_tensor(seed, dtype=torch.int64, device=device).reshape(1)
    K.dropout_mask_kernel[grid](
        keep.view(torch.uint8), seed, 0, lq, lk, heads, dropout_p, BLOCK_M=block, BLOCK_N=block
    )
    return keep
