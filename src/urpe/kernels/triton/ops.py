"""The Triton URPE kernel in three layers: raw ops, autograd, public function.

1. Raw ops `urpe::triton_attention_forward` / `urpe::triton_attention_backward`
   (`torch.library.custom_op`, with fake implementations so `torch.compile` traces through them):
   tensors and scalars only. A bias or gate arrives as (tensor, index, kind), kind one of
   `kernels.NO_TERM, TOEPLITZ, RELATION, DENSE`.
2. Autograd: `torch.library.register_autograd` with a `setup_context`, so `torch.func` works.
3. `triton_attention`: the documented function, with `urpe.attention`'s arguments.

Block sizes. On CUDA the launches are autotuned (`triton.autotune`). The tuning key is
(next power of two of Lq, of Lk, head dim, value dim, normalisation, causal, padding, dropout,
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
import math
import os

import torch
import triton
from torch import Tensor

from . import kernels as K

NORMALIZATION_CODES = {"softmax": K.SOFTMAX, "exp": K.EXP, "l2": K.L2, "relu2": K.RELU2}
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


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


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


def _pad_bytes(q: Tensor, key_padding_mask: Tensor | None) -> Tensor:
    """The padding mask as contiguous (B, Lk) bytes (the kernels index it as b * Lk + j)."""
    if key_padding_mask is None:
        return _dummy(q, torch.uint8)
    return key_padding_mask.contiguous().view(torch.uint8)


def _term_args(q: Tensor, k: Tensor, term: Tensor | None, index: Tensor | None, kind: int):
    """Kernel arguments (ptr, idx, s_b, s_h, s_i, s_j, K) of a bias or gate."""
    b, h, lq = q.shape[:3]
    lk = k.shape[2]
    if kind == K.NO_TERM:
        return (_dummy(q), _dummy(q, torch.int32), 0, 0, 0, 0, 0)
    if kind == K.TOEPLITZ:
        table = term.contiguous()
        s_h = 0 if table.shape[0] == 1 else table.stride(0)
        return (table, _dummy(q, torch.int32), 0, s_h, 0, 0, (table.shape[1] - 1) // 2)
    if kind == K.RELATION:
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
               "CAUSAL", "HAS_PAD", "DROPOUT"]  # fmt: skip
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


def _fixed_blocks(block_m: int, block_n: int) -> tuple[int, int] | None:
    """The one configuration to run, or None to autotune."""
    if block_m > 0 and block_n > 0:
        return block_m, block_n
    if interpreting():
        return INTERPRETER_BLOCK, INTERPRETER_BLOCK
    return None


# --------------------------------------------------------------------------------------------
# Layer 1: raw ops


@torch.library.custom_op("urpe::triton_attention_forward", mutates_args=())
def attention_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_padding_mask: Tensor | None,
    bias: Tensor | None,
    bias_index: Tensor | None,
    bias_kind: int,
    gate: Tensor | None,
    gate_index: Tensor | None,
    gate_kind: int,
    is_causal: bool,
    normalization: int,
    scale: float,
    dropout_p: float,
    seed: int,
    rng_offset: int,
    block_m: int,
    block_n: int,
) -> tuple[Tensor, Tensor]:
    """Output (B, H, Lq, Dv) in q's dtype and the row statistic (B, H, Lq) the backward needs
    (softmax: log-sum-exp; l2: m + log(sum e^2(s-m))/2; relu2: visible key count)."""
    b, h, lq, _ = q.shape
    dv = v.shape[-1]
    out = torch.empty(b, h, lq, dv, device=q.device, dtype=q.dtype)
    stat = torch.empty(b, h, lq, device=q.device, dtype=_acc_dtype(q.dtype))
    pad = _pad_bytes(q, key_padding_mask)
    flags = _compile_flags(q)
    lq_bucket, lk_bucket = _buckets(q, k)
    args = (
        q, k, v, out, stat, pad,
        *_term_args(q, k, bias, bias_index, bias_kind),
        *_term_args(q, k, gate, gate_index, gate_kind),
        *_common_args(q, k, v), scale, dropout_p, seed, rng_offset, lq_bucket, lk_bucket,
    )  # fmt: skip
    meta = dict(
        B_KIND=bias_kind,
        C_KIND=gate_kind,
        NORM=normalization,
        CAUSAL=is_causal,
        HAS_PAD=key_padding_mask is not None,
        DROPOUT=dropout_p > 0.0,
        BLOCK_DV=max(16, triton.next_power_of_2(dv)),
        **flags,
    )
    blocks = _fixed_blocks(block_m, block_n)
    if blocks is None:
        grid = lambda cfg: (triton.cdiv(lq, cfg["BLOCK_M"]), b * h)  # noqa: E731
        _tuned("forward")[grid](*args, **meta)
    else:
        grid = (triton.cdiv(lq, blocks[0]), b * h)
        K.attention_fwd_kernel[grid](*args, **meta, BLOCK_M=blocks[0], BLOCK_N=blocks[1])
    return out, stat


@attention_forward.register_fake
def _(q, k, v, key_padding_mask, bias, bias_index, bias_kind, gate, gate_index, gate_kind,
      is_causal, normalization, scale, dropout_p, seed, rng_offset, block_m, block_n):  # fmt: skip
    b, h, lq, _ = q.shape
    out = q.new_empty(b, h, lq, v.shape[-1])
    return out, q.new_empty(b, h, lq, dtype=_acc_dtype(q.dtype))


def _term_grad_buffer(q: Tensor, k: Tensor, term: Tensor | None, kind: int, needed: bool):
    """(buffer, head stride) that the dK/dV kernel accumulates a term's gradient into."""
    acc = _acc_dtype(q.dtype)
    if not needed or kind == K.NO_TERM:
        return _dummy(q, acc), 0
    if kind == K.DENSE:  # full (B, H, Lq, Lk); summed to the term's shape afterwards
        b, h, lq = q.shape[:3]
        return torch.zeros(b, h, lq, k.shape[2], device=q.device, dtype=acc), h
    grad = torch.zeros(term.shape, device=q.device, dtype=acc)
    return grad, (0 if term.shape[0] == 1 else grad.stride(0))


def _term_grad_result(buffer: Tensor, term: Tensor | None, kind: int, needed: bool) -> Tensor:
    if not needed or kind == K.NO_TERM:
        return buffer.new_empty(0)
    if kind == K.DENSE:
        buffer = buffer.sum_to_size(term.shape)
    return buffer.to(term.dtype)


@torch.library.custom_op("urpe::triton_attention_backward", mutates_args=())
def attention_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    stat: Tensor,
    key_padding_mask: Tensor | None,
    bias: Tensor | None,
    bias_index: Tensor | None,
    bias_kind: int,
    gate: Tensor | None,
    gate_index: Tensor | None,
    gate_kind: int,
    is_causal: bool,
    normalization: int,
    scale: float,
    dropout_p: float,
    seed: int,
    rng_offset: int,
    bias_grad: bool,
    gate_grad: bool,
    block_m: int,
    block_n: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients (dq, dk, dv, d bias, d gate); a term's gradient has the term tensor's shape
    (empty when not asked for)."""
    b, h, lq, d = q.shape
    hk, lk, dv = k.shape[1], k.shape[2], v.shape[3]
    acc = _acc_dtype(q.dtype)
    grad_out = grad_out.contiguous()
    if normalization in (K.SOFTMAX, K.L2):  # delta_i = dO_i . O_i
        delta = (grad_out.to(acc) * out.to(acc)).sum(-1)
    else:
        delta = _dummy(q, acc)
    dq = torch.empty(b, h, lq, d, device=q.device, dtype=q.dtype)
    dk = torch.empty(b, hk, lk, d, device=q.device, dtype=k.dtype)
    dv_ = torch.empty(b, hk, lk, dv, device=q.device, dtype=v.dtype)
    pad = _pad_bytes(q, key_padding_mask)
    bias_args = _term_args(q, k, bias, bias_index, bias_kind)
    gate_args = _term_args(q, k, gate, gate_index, gate_kind)
    d_bias, d_bias_sh = _term_grad_buffer(q, k, bias, bias_kind, bias_grad)
    d_gate, d_gate_sh = _term_grad_buffer(q, k, gate, gate_kind, gate_grad)
    common = (*_common_args(q, k, v), scale, dropout_p, seed, rng_offset, *_buckets(q, k))
    meta = dict(
        B_KIND=bias_kind,
        C_KIND=gate_kind,
        NORM=normalization,
        CAUSAL=is_causal,
        HAS_PAD=key_padding_mask is not None,
        DROPOUT=dropout_p > 0.0,
        BLOCK_DV=max(16, triton.next_power_of_2(dv)),
        **_compile_flags(q),
    )
    kv_args = (
        q, k, v, grad_out, stat, delta, dk, dv_, pad,
        *bias_args, d_bias, d_bias_sh, *gate_args, d_gate, d_gate_sh, *common,
    )  # fmt: skip
    kv_meta = dict(meta, B_GRAD=bias_grad and bias_kind != K.NO_TERM,
                   C_GRAD=gate_grad and gate_kind != K.NO_TERM)  # fmt: skip
    q_args = (q, k, v, grad_out, stat, delta, dq, pad, *bias_args, *gate_args, *common)
    blocks = _fixed_blocks(block_m, block_n)
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
        _term_grad_result(d_bias, bias, bias_kind, bias_grad),
        _term_grad_result(d_gate, gate, gate_kind, gate_grad),
    )


@attention_backward.register_fake
def _(grad_out, q, k, v, out, stat, key_padding_mask, bias, bias_index, bias_kind, gate,
      gate_index, gate_kind, is_causal, normalization, scale, dropout_p, seed, rng_offset,
      bias_grad, gate_grad, block_m, block_n):  # fmt: skip
    def term(t, kind, needed):
        return t.new_empty(t.shape) if needed and kind != K.NO_TERM else q.new_empty(0)

    return (
        torch.empty_like(q),
        torch.empty_like(k),
        torch.empty_like(v),
        term(bias, bias_kind, bias_grad),
        term(gate, gate_kind, gate_grad),
    )


# --------------------------------------------------------------------------------------------
# Layer 2: autograd

_SCALARS = ("bias_kind", "gate_kind", "is_causal", "normalization", "scale", "dropout_p", "seed",
            "rng_offset", "block_m", "block_n")  # fmt: skip


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, key_padding_mask, bias, bias_index, _, gate, gate_index = inputs[:9]
    out, stat = output
    ctx.save_for_backward(q, k, v, out, stat, key_padding_mask, bias, bias_index, gate, gate_index)
    # the scalar inputs, by name: bias_kind at 6, gate_kind at 9, is_causal ... block_n after
    ctx.scalars = dict(zip(_SCALARS, (inputs[6], *inputs[9:]), strict=True))


def _backward(ctx, grad_out: Tensor, _grad_stat: Tensor):
    q, k, v, out, stat, key_padding_mask, bias, bias_index, gate, gate_index = ctx.saved_tensors
    s = ctx.scalars
    needs = ctx.needs_input_grad
    bias_grad = bool(needs[4]) and s["bias_kind"] != K.NO_TERM
    gate_grad = bool(needs[7]) and s["gate_kind"] != K.NO_TERM
    dq, dk, dv, d_bias, d_gate = attention_backward(
        grad_out, q, k, v, out, stat, key_padding_mask, bias, bias_index, s["bias_kind"], gate,
        gate_index, s["gate_kind"], s["is_causal"], s["normalization"], s["scale"],
        s["dropout_p"], s["seed"], s["rng_offset"], bias_grad, gate_grad, s["block_m"],
        s["block_n"],
    )  # fmt: skip
    return (
        dq, dk, dv, None, d_bias if bias_grad else None, None, None,
        d_gate if gate_grad else None, None, *([None] * 10),
    )  # fmt: skip


torch.library.register_autograd(
    "urpe::triton_attention_forward", _backward, setup_context=_setup_context
)


# --------------------------------------------------------------------------------------------
# Layer 3: the public function


def split_term(term) -> tuple[Tensor | None, Tensor | None, int]:
    """A bias or gate as the raw op's (tensor, index, kind)."""
    from ..tables import Relation, Toeplitz

    if term is None:
        return None, None, K.NO_TERM
    if isinstance(term, Toeplitz):
        return term.table, None, K.TOEPLITZ
    if isinstance(term, Relation):
        return term.table, term.index, K.RELATION
    return term, None, K.DENSE


def triton_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    bias=None,
    gate=None,
    key_padding_mask: Tensor | None = None,
    is_causal: bool = False,
    normalization: str = "softmax",
    scale: float | None = None,
    dropout_p: float = 0.0,
    seed: int | None = None,
    block_m: int = 0,
    block_n: int = 0,
) -> Tensor:
    """URPE attention on the Triton kernel: out = dropout(normalize(scale q k^T + B) * C) @ v.

    Args:
        q: (B, H, Lq, D). k: (B, Hkv, Lk, D), v: (B, Hkv, Lk, Dv), with H a multiple of Hkv
            (grouped-query attention: query head h reads key/value head h // (H / Hkv)).
        bias, gate: B and C as in `urpe.attention` (dense tensor, `Toeplitz` or `Relation`).
        key_padding_mask: (B, Lk) bool, True marks a padded key.
        is_causal: query i sees keys j <= i + Lk - Lq.
        normalization: "softmax", "exp", "l2" or "relu2".
        scale: logit scale, default 1 / sqrt(D).
        dropout_p: dropout on the gated weights; the mask comes from Philox(seed) and is
            regenerated in the backward pass, never stored.
        seed: dropout seed (default: drawn from torch's global CPU generator, so
            `torch.manual_seed` reproduces the masks).
        block_m, block_n: fixed tile sizes (powers of two >= 16); 0 autotunes on CUDA.

    Returns:
        (B, H, Lq, Dv) in q's dtype. Half-precision inputs accumulate in float32.
    """
    from . import triton_unsupported

    reason = triton_unsupported(
        q=q, k=k, v=v, bias=bias, gate=gate, key_padding_mask=key_padding_mask,
        normalization=normalization, dropout_p=dropout_p,
    )  # fmt: skip
    if reason is not None:
        raise ValueError(f"backend 'triton' cannot run this call: {reason}")
    for name, size in (("block_m", block_m), ("block_n", block_n)):
        if size and (size < 16 or size & (size - 1)):
            raise ValueError(f"{name} must be 0 (autotune) or a power of two >= 16, got {size}")
    if dropout_p > 0.0 and seed is None:
        seed = int(torch.randint(0, 2**62, ()).item())
    bias_tensor, bias_index, bias_kind = split_term(bias)
    gate_tensor, gate_index, gate_kind = split_term(gate)
    out, _ = attention_forward(
        q,
        k,
        v,
        key_padding_mask,
        bias_tensor,
        bias_index,
        bias_kind,
        gate_tensor,
        gate_index,
        gate_kind,
        bool(is_causal),
        NORMALIZATION_CODES[normalization],
        1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale),
        float(dropout_p),
        0 if seed is None else int(seed),
        0,
        int(block_m),
        int(block_n),
    )
    return out


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
