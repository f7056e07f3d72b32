"""The Triton URPE kernel in three layers: raw ops, autograd, public function.

1. Raw ops `urpe::triton_attention_forward` / `urpe::triton_attention_backward`
   (`torch.library.custom_op`, with fake implementations so `torch.compile` traces through them):
   tensors and scalars only, in the fused backend's signature. A bias or gate arrives as
   (tensor, index, kind), kind one of "none", "toeplitz", "relation", "dense"; the attn_mask is
   boolean (a float one is added to the bias first, in layer 3). Their vmap rules fold a vmapped
   dim into the batch, or loop where folding would be wrong (`urpe.kernels.composable`).
2. Autograd: `TritonAttention`, the autograd.Function with `setup_context` shared with the fused
   backend, so `torch.func.grad`, `vmap`, `functional_call` and `torch.compile(fullgraph=True)`
   compose with the kernel.
3. `triton_run(spec)`, the backend, and `triton_attention`, the documented function with
   `urpe.attention`'s arguments.

Block sizes. On CUDA the launches are autotuned (`triton.autotune`). The tuning key is
(next power of two of Lq, of Lk, head dim, value dim, normalisation, causal, padding, a boolean
attn_mask, dropout,
the kinds of bias and gate and whether they need gradients) plus the dtype of every tensor
argument (Triton adds those itself): a new length bucket, head size, dtype or variant is tuned
once, on its first call, and every later call with the same key reuses the winner from the
autotuner's in-process dictionary. `cache_results=True` also stores the winners in Triton's
on-disk cache (`TRITON_CACHE_DIR`, default ~/.triton/cache) beside the compiled kernels, so a new
process with the same key skips the tuning. The backward kernels zero their atomic accumulators
between trials (`reset_to_zero`). Under the interpreter, or when `block_m`/`block_n` are given,
one fixed configuration runs instead.

Table gradients are NOT bitwise deterministic on a GPU: each tile reduces its contribution in
registers (BLOCK_M + BLOCK_N - 1 anti-diagonal sums for a Toeplitz table, a Relation tile
entry by entry) and adds it to the float32 table gradient with `tl.atomic_add`, whose order
varies between runs; results differ by float32 rounding only. A deterministic combine would keep
every tile's partial sums and reduce them in a fixed order: B * H * (L / BLOCK)^2 * 2 BLOCK
floats, 1 GiB at B=4, H=16, L=16k, BLOCK=64, which breaks the kernel's memory linear in L.
dQ, dK, dV and dense-term gradients are written once per entry and are deterministic.
"""

from __future__ import annotations

import inspect
import os
import warnings

import torch
import triton
from torch import Tensor

from ..composable import define_attention_ops
from ..dtypes import compute_dtype
from ..layout import BackwardArgs, ForwardArgs
from ..reference import draw_seed
from ..spec import AttentionSpec, resolve
from ..tables import dense_term
from . import kernels as K

NORMALIZATION_CODES = {"softmax": K.SOFTMAX.value, "exp": K.EXP.value, "l2": K.L2.value,
                       "relu2": K.RELU2.value}  # fmt: skip
# Under the interpreter: small tiles, so that tests at small lengths cross several of them.
INTERPRETER_BLOCK = 16


def interpreting() -> bool:
    """Whether Triton runs its CPU interpreter (TRITON_INTERPRET=1 at import)."""
    knobs = getattr(triton, "knobs", None)  # Triton >= 3.4; older ones read the environment
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _autotune(configs, **options):
    """`triton.autotune`, persisting results on disk where this Triton can (>= 3.3)."""
    if "cache_results" in inspect.signature(triton.autotune).parameters:
        options["cache_results"] = True
    return triton.autotune(configs, **options)


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


_TUNING_KEY = ["lq_bucket", "lk_bucket", "BLOCK_D", "BLOCK_DV", "B_KIND", "C_KIND", "NORM",
               "CAUSAL", "HAS_PAD", "HAS_MASK", "DROPOUT"]  # fmt: skip
_autotuned: dict[str, object] = {}


# (BLOCK_M, BLOCK_N, num_warps, num_stages) tried per kernel: four each, FlashAttention-2's
# usual shapes, so that a new key costs twelve compilations rather than dozens.
FORWARD_CONFIGS = ((128, 64, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 4, 4))
BACKWARD_KV_CONFIGS = ((64, 64, 4, 2), (32, 64, 4, 2), (64, 128, 8, 2), (32, 128, 4, 2))
BACKWARD_Q_CONFIGS = ((64, 64, 4, 2), (128, 64, 8, 2), (64, 32, 4, 2), (128, 32, 4, 2))


def _configs(shapes, with_width: bool = False):
    configs = []
    for m, n, warps, stages in shapes:
        meta = dict(BLOCK_M=m, BLOCK_N=n)
        if with_width:  # the Toeplitz gradient's diagonal count, padded to a power of two
            meta["WIDTH"] = triton.next_power_of_2(m + n - 1)
        configs.append(triton.Config(meta, num_warps=warps, num_stages=stages))
    return configs


def _tuned(name: str):
    """The autotuned launcher of a kernel (built on first use: never under the interpreter)."""
    if name not in _autotuned:
        if name == "forward":
            kernel = _autotune(_configs(FORWARD_CONFIGS), key=_TUNING_KEY)(K.attention_fwd_kernel)
        elif name == "backward_kv":
            kernel = _autotune(
                _configs(BACKWARD_KV_CONFIGS, with_width=True),
                key=[*_TUNING_KEY, "B_GRAD", "C_GRAD"],
                reset_to_zero=["dB_ptr", "dC_ptr"],  # atomically accumulated: zero per trial
            )(K.attention_bwd_kv_kernel)
        else:
            kernel = _autotune(_configs(BACKWARD_Q_CONFIGS), key=_TUNING_KEY)(
                K.attention_bwd_q_kernel
            )
        _autotuned[name] = kernel
    return _autotuned[name]


def _fixed_blocks(block_q: int, block_k: int) -> tuple[int, int] | None:
    """The one configuration (BLOCK_M queries x BLOCK_N keys) to run, or None to autotune."""
    if block_q > 0 and block_k > 0:
        return block_q, block_k
    if interpreting():
        return INTERPRETER_BLOCK, INTERPRETER_BLOCK
    return None


# --------------------------------------------------------------------------------------------
# Layer 1: the raw ops' bodies, on the argument layout every such kernel shares
# (`urpe.kernels.layout`): `define_attention_ops` registers them with the vmap rules and the
# autograd Function of the fused backend.

KIND_CODES = {"none": K.NO_TERM.value, "toeplitz": K.TOEPLITZ.value, "relation": K.RELATION.value,
              "dense": K.DENSE.value}  # fmt: skip


def _launch_meta(args: ForwardArgs, kinds: tuple[int, int]) -> dict:
    """The constexpr arguments shared by the three kernels."""
    return dict(
        B_KIND=kinds[0],
        C_KIND=kinds[1],
        NORM=NORMALIZATION_CODES[args.normalization],
        CAUSAL=args.is_causal,
        HAS_PAD=args.key_padding_mask is not None,
        HAS_MASK=args.attn_mask is not None,
        DROPOUT=args.dropout_p > 0.0,
        BLOCK_DV=max(16, triton.next_power_of_2(args.v.shape[-1])),
        **_compile_flags(args.q),
    )


def _seed_value(seed: Tensor | None) -> int:
    # the op bodies run eagerly, so reading the seed tensor here costs no graph break
    return 0 if seed is None else int(seed)


def _forward(args: ForwardArgs) -> tuple[Tensor, Tensor]:
    """Output (B, H, Lq, Dv) in q's dtype and the row statistic (B, H, Lq) the backward needs
    (softmax: log-sum-exp; l2: m + log(sum e^2(s-m))/2; relu2: visible key count).

    The attn_mask is None or boolean here (a float one is added to the bias in layer 3).
    """
    q, k, v = args.q, args.k, args.v
    b, h, lq, _ = q.shape
    out = torch.empty(b, h, lq, v.shape[-1], device=q.device, dtype=q.dtype)
    stat = torch.empty(b, h, lq, device=q.device, dtype=compute_dtype(q.dtype))
    kinds = (KIND_CODES[args.bias_kind], KIND_CODES[args.gate_kind])
    launch = (
        q, k, v, out, stat, _pad_bytes(q, k, args.key_padding_mask),
        *_mask_args(q, k, args.attn_mask),
        *_term_args(q, k, args.bias, args.bias_index, kinds[0]),
        *_term_args(q, k, args.gate, args.gate_index, kinds[1]),
        *_common_args(q, k, v), args.scale, args.dropout_p, _seed_value(args.dropout_seed), 0,
        *_buckets(q, k),
    )  # fmt: skip
    meta = _launch_meta(args, kinds)
    blocks = _fixed_blocks(args.block_q, args.block_k)
    if blocks is None:
        grid = lambda cfg: (triton.cdiv(lq, cfg["BLOCK_M"]), b * h)  # noqa: E731
        _tuned("forward")[grid](*launch, **meta)
    else:
        grid = (triton.cdiv(lq, blocks[0]), b * h)
        K.attention_fwd_kernel[grid](*launch, **meta, BLOCK_M=blocks[0], BLOCK_N=blocks[1])
    return out, stat


def _forward_fake(args: ForwardArgs):
    b, h, lq, _ = args.q.shape
    out = args.q.new_empty(b, h, lq, args.v.shape[-1])
    return out, args.q.new_empty(b, h, lq, dtype=compute_dtype(args.q.dtype))


def _term_grad_buffer(q: Tensor, k: Tensor, term: Tensor | None, kind: int, needed: bool):
    """(buffer, head stride) that the dK/dV kernel accumulates a term's gradient into."""
    acc = compute_dtype(q.dtype)
    if not needed or kind == K.NO_TERM.value:
        return _dummy(q, acc), 0
    if kind == K.DENSE.value:  # full (B, H, Lq, Lk); summed to the term's shape afterwards
        b, h, lq = q.shape[:3]
        return torch.zeros(b, h, lq, k.shape[2], device=q.device, dtype=acc), h
    grad = torch.zeros(term.shape, device=q.device, dtype=acc)
    return grad, (0 if term.shape[0] == 1 else grad.stride(0))


def _term_grad_result(buffer: Tensor, term, kind: int, needed: bool) -> Tensor | None:
    if not needed or kind == K.NO_TERM.value:
        return None
    if kind == K.DENSE.value:
        buffer = buffer.sum_to_size(term.shape)
    return buffer.to(term.dtype)


def _backward(grads: BackwardArgs) -> tuple:
    """Gradients (dq, dk, dv, d bias, d gate, None): a term's gradient has the term tensor's
    shape, None where not asked for. The attn_mask is boolean here (a float one was added to the
    bias), so it has no gradient."""
    args = grads.forward
    q, k, v = args.q, args.k, args.v
    b, h, lq, d = q.shape
    hk, lk, dv = k.shape[1], k.shape[2], v.shape[3]
    acc = compute_dtype(q.dtype)
    kinds = (KIND_CODES[args.bias_kind], KIND_CODES[args.gate_kind])
    bias_grad = grads.needs_bias and kinds[0] != K.NO_TERM.value
    gate_grad = grads.needs_gate and kinds[1] != K.NO_TERM.value
    grad_out = grads.grad_out.contiguous()
    if NORMALIZATION_CODES[args.normalization] in (K.SOFTMAX.value, K.L2.value):
        delta = (grad_out.to(acc) * grads.out.to(acc)).sum(-1)  # delta_i = dO_i . O_i
    else:
        delta = _dummy(q, acc)
    dq = torch.empty(b, h, lq, d, device=q.device, dtype=q.dtype)
    dk = torch.empty(b, hk, lk, d, device=q.device, dtype=k.dtype)
    dv_ = torch.empty(b, hk, lk, dv, device=q.device, dtype=v.dtype)
    masks = (_pad_bytes(q, k, args.key_padding_mask), *_mask_args(q, k, args.attn_mask))
    bias_args = _term_args(q, k, args.bias, args.bias_index, kinds[0])
    gate_args = _term_args(q, k, args.gate, args.gate_index, kinds[1])
    d_bias, d_bias_sh = _term_grad_buffer(q, k, args.bias, kinds[0], bias_grad)
    d_gate, d_gate_sh = _term_grad_buffer(q, k, args.gate, kinds[1], gate_grad)
    common = (*_common_args(q, k, v), args.scale, args.dropout_p,
              _seed_value(args.dropout_seed), 0, *_buckets(q, k))  # fmt: skip
    meta = _launch_meta(args, kinds)
    kv_args = (
        q, k, v, grad_out, grads.stat, delta, dk, dv_, *masks,
        *bias_args, d_bias, d_bias_sh, *gate_args, d_gate, d_gate_sh, *common,
    )  # fmt: skip
    kv_meta = dict(meta, B_GRAD=bias_grad, C_GRAD=gate_grad)
    q_args = (q, k, v, grad_out, grads.stat, delta, dq, *masks, *bias_args, *gate_args, *common)
    blocks = _fixed_blocks(args.block_q, args.block_k)
    if blocks is None:
        kv_grid = lambda cfg: (triton.cdiv(lk, cfg["BLOCK_N"]), b * hk)  # noqa: E731
        _tuned("backward_kv")[kv_grid](*kv_args, **kv_meta)
        q_grid = lambda cfg: (triton.cdiv(lq, cfg["BLOCK_M"]), b * h)  # noqa: E731
        _tuned("backward_q")[q_grid](*q_args, **meta)
    else:
        bm, bn = blocks
        width = triton.next_power_of_2(bm + bn - 1)
        kv_grid = (triton.cdiv(lk, bn), b * hk)
        K.attention_bwd_kv_kernel[kv_grid](*kv_args, **kv_meta, BLOCK_M=bm, BLOCK_N=bn, WIDTH=width)
        K.attention_bwd_q_kernel[(triton.cdiv(lq, bm), b * h)](
            *q_args, **meta, BLOCK_M=bm, BLOCK_N=bn
        )
    return (
        dq,
        dk,
        dv_,
        _term_grad_result(d_bias, args.bias, kinds[0], bias_grad),
        _term_grad_result(d_gate, args.gate, kinds[1], gate_grad),
        None,
    )


# --------------------------------------------------------------------------------------------
# Layer 2: autograd (shared with the fused backend)

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
    return (mask if bias is None else bias.to(dtype) + mask), None


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
        bias, gate: B and C as in `urpe.attention` (dense tensor, `Toeplitz` or `Relation`).
        attn_mask: as in `urpe.attention`: bool (True takes part; read by the kernel per tile)
            or float (M, added to the bias, which is then expanded to a dense tensor).
        key_padding_mask: (..., Lk) bool, True marks a padded key.
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
    from . import spec_unsupported

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
        is_causal=is_causal, normalization=normalization, scale=scale, dropout_p=dropout_p,
        dropout_seed=given["dropout_seed"], enable_gqa=True,
    )  # fmt: skip
    reason = spec_unsupported(spec)
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
    grid = (triton.cdiv(lq, block), triton.cdiv(lk, block), batch * heads)
    K.dropout_mask_kernel[grid](
        keep.view(torch.uint8), seed, 0, lq, lk, heads, dropout_p, BLOCK_M=block, BLOCK_N=block
    )
    return keep
