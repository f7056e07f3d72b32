"""Attention calls where what surrounds the kernel shows (issue 28), for the model benchmark.

    calls   one decoding call: B=1, one query against a KV cache (the main case, a
            grouped-query case and a long cache), forward under no_grad as in generation:
            SDPA against urpe.attention without terms, with a Toeplitz gate and with a Toeplitz
            bias, on "auto", "reference" and "cpp"
    short   short rows (the quick model's attention), forward and forward+backward, causal and
            not: SDPA against URPE and RPE on "auto" and the CPU kernels
    bf16    long rows in bfloat16, forward: SDPA against cpp URPE (and "auto")

At Lq = 1 every cached key is visible under urpe's causal rule (the last query sees the last
key), so SDPA runs without a mask: the same attention.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from urpe.bench.inputs import make_inputs
from urpe.bench.measure import Method, build_calls
from urpe.bench.rows import Row, backend_row, rows_for
from urpe.kernels import Toeplitz, attention, select_backend

from .model_sizes import Sizes
from .timed import Timed

# term name -> (bias, gate)
TERMS = {"none": (False, False), "gate": (False, True), "bias": (True, False), "urpe": (True, True)}
DECODE_TERMS = ("none", "gate", "bias")
DECODE_BACKENDS = ("auto", "reference", "cpp")


def decode_inputs(heads: int, kv_heads: int, keys: int, head_dim: int, seed: int = 0) -> dict:
    """One new token's queries against `keys` cached keys and values, and the two Toeplitz
    tables a model would hold as parameters (K = keys - 1: every offset has its entry)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, 1, head_dim, generator=gen)  # (B, H, 1, D)
    kv_shape = (1, kv_heads, keys, head_dim)  # (B, Hkv, Lk, D): the cache
    k, v = (torch.randn(kv_shape, generator=gen) for _ in range(2))
    width = 2 * keys - 1
    table_b = (0.02 * torch.randn(heads, width, generator=gen)).requires_grad_()  # (H, 2K+1)
    table_c = (1 + 0.1 * torch.randn(heads, width, generator=gen)).requires_grad_()
    return dict(q=q, k=k, v=v, table_b=table_b, table_c=table_c)


def _terms(inputs: dict, term: str) -> dict:
    """The bias and gate keywords of `term` (a key of TERMS) on these inputs' tables."""
    with_bias, with_gate = TERMS[term]
    return dict(
        bias=Toeplitz(inputs["table_b"]) if with_bias else None,
        gate=Toeplitz(inputs["table_c"]) if with_gate else None,
    )


def auto_picks(inputs: dict, causal: bool, terms: tuple[str, ...]) -> str:
    """Which kernel "auto" runs for each of these term sets: "auto runs gate: cpp, ..."."""
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    gqa = k.shape[1] != q.shape[1]
    picks = {
        term: select_backend(
            "auto", q, k, v, is_causal=causal, enable_gqa=gqa, **_terms(inputs, term)
        ).name
        for term in terms
    }
    return "auto runs " + ", ".join(f"{term}: {name}" for term, name in picks.items())


def _decode_sdpa(inputs: dict, causal: bool):
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    gqa = k.shape[1] != q.shape[1]
    return lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)


def _decode_urpe(backend: str, term: str):
    def build(inputs: dict, causal: bool):
        q, k, v = inputs["q"], inputs["k"], inputs["v"]
        gqa, terms = k.shape[1] != q.shape[1], _terms(inputs, term)
        return lambda: attention(q, k, v, is_causal=True, enable_gqa=gqa, backend=backend, **terms)

    return build


FORWARD = ("cpu",)  # forward_only_on: these rows are timed forward only
DECODE_ROWS = [
    Row("sdpa", "F.scaled_dot_product_attention, no mask", _decode_sdpa, forward_only_on=FORWARD),
    *(
        Row(
            f"{backend}_{term}",
            f"urpe.attention(backend={backend!r}), terms: {term}",
            _decode_urpe(backend, term),
            forward_only_on=FORWARD,
        )
        for backend in DECODE_BACKENDS
        for term in DECODE_TERMS
    ),
]
AUTO_ROWS = [
    Row("auto_urpe", "urpe.attention(backend='auto'), Toeplitz B and C", backend_row("auto", True)),
    Row("auto_rpe", "urpe.attention(backend='auto'), Toeplitz B", backend_row("auto", False)),
]


def _built(rows: list[Row], cases: dict, progress, loops: int, about: str) -> Timed:
    """Timed calls of `rows` per case (case -> (inputs, setting, shape)); rows that fail to
    build are recorded as skipped with the reason."""
    timed = Timed(cases={}, shapes={}, about=about, loops=loops)
    method = Method("cpu", None, warmup=2, progress=progress)
    for case, (inputs, setting, shape) in cases.items():
        calls, skipped = build_calls(rows, inputs, setting, method)
        timed.cases[case], timed.shapes[case] = calls, shape
        timed.skipped += [
            dict(case=case, shape=shape, name=r["name"], mode=r["mode"], skipped=r["skipped"])
            for r in skipped
        ]
    return timed


def decode_calls(sizes: Sizes, progress) -> Timed:
    main, long = sizes.decode_keys
    h, d = sizes.decode_heads, sizes.decode_head_dim
    # case -> (key heads, cached keys)
    shapes = dict(decode=(h, main), decode_gqa=(sizes.decode_kv_heads, main), decode_long=(h, long))
    cases = {}
    for case, (kv_heads, keys) in shapes.items():
        inputs = decode_inputs(h, kv_heads, keys, d)
        shape = f"B=1, H={h}, Hkv={kv_heads}, Lq=1, Lk={keys}, D={d}"
        shape += f" ({auto_picks(inputs, True, DECODE_TERMS)})"
        cases[case] = (inputs, dict(length=keys), shape)
    about = (
        "Forward under no_grad, as in generation; the tables cover every offset. SDPA "
        "runs without a mask: at Lq=1 every cached key is visible under urpe's causal "
        "rule too. Rows: <backend>_<terms>."
    )
    return _built(DECODE_ROWS, cases, progress, sizes.call_loops, about)


def _kernel_rows(names: list[str]) -> list[Row]:
    """The CPU rows of `urpe bench attention` with these names, where registered here."""
    registered = rows_for("cpu")
    return [registered[name] for name in names if name in registered]


def short_calls(sizes: Sizes, progress) -> Timed:
    batch, heads, length, head_dim = sizes.short
    rows = [
        *_kernel_rows(["sdpa"]),
        *AUTO_ROWS,
        *_kernel_rows(["cpp_urpe", "blockwise_urpe", "reference_urpe"]),
    ]
    inputs = make_inputs(batch, heads, length, head_dim, torch.float32)
    cases = {
        case: (
            inputs,
            dict(length=length, causal=causal),
            f"is_causal={causal} ({auto_picks(inputs, causal, ('urpe', 'bias'))})",
        )
        for case, causal in (("causal", True), ("not_causal", False))
    }
    about = (
        f"B={batch}, H={heads}, L={length}, D={head_dim}, float32; URPE (Toeplitz B and "
        "C) and RPE (B only) on 'auto' and on each CPU kernel."
    )
    return _built(rows, cases, progress, sizes.short_loops, about)


def bf16_calls(sizes: Sizes, progress) -> Timed:
    batch, heads, length, head_dim = sizes.long_bf16
    rows = [*_kernel_rows(["sdpa", "cpp_urpe"]), AUTO_ROWS[0]]
    rows = [replace(row, forward_only_on=FORWARD) for row in rows]
    inputs = make_inputs(batch, heads, length, head_dim, torch.bfloat16)
    shape = f"B={batch}, H={heads}, L={length}, D={head_dim}, not causal"
    shape += f" ({auto_picks(inputs, False, ('urpe',))})"
    about = "Forward under no_grad; URPE: Toeplitz B and C."
    return _built(rows, {"bf16": (inputs, dict(length=length), shape)}, progress, 1, about)
