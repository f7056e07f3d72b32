"""Masks that broadcast, on every backend, against the reference: a randomized differential test.

`attn_mask` may be given at any shape that broadcasts to (..., H, Lq, Lk): (Lq, 1), (1, Lk),
(1, 1), (H, 1, 1), (B, 1, 1, 1), ...; `key_padding_mask` at any shape that broadcasts to
(..., Lk). Every count or sum a kernel takes over a mask must count the keys the mask stands for,
not its stored entries: relu2 divides by the number of visible keys, and an all-True (Lq, 1) mask
once multiplied the output of the C++ and blockwise kernels by Lk.

Each case draws shapes (odd lengths, Lq != Lk, grouped queries, one or two batch dims), both
masks at a random broadcast shape (bool or float attn_mask), causal masking, a normalisation, a
bias and a gate, and sometimes a NaN key row (the non-finite rule reads the masks too). Every
native CPU backend (reference, sdpa, blockwise, cpp), Triton under its interpreter and FlexAttention
(its CPU backward lifted, as in test_flex) run it in float64 against the reference: output and
the gradients of q, k, v, a float mask, the bias and the gate.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.attention.flex_attention as flex_module

from urpe.kernels import Relation, Toeplitz, attention, native_backends, reference_attention
from urpe.kernels.blockwise import blockwise_attention
from urpe.kernels.cpp import cpp_attention
from urpe.kernels.cpp import unavailable as cpp_unavailable
from urpe.kernels.execute import execute
from urpe.kernels.flex import flex_run, flex_spec_unsupported
from urpe.kernels.masks import visible_key_counts
from urpe.kernels.spec import resolve
from urpe.kernels.triton import triton_unsupported

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
F64 = dict(dtype=torch.float64)
NORMALIZATIONS = ("softmax", "exp", "l2", "relu2")
HEADS = ((1, 1), (2, 2), (4, 2), (3, 1))  # (H, Hkv)


def _broadcast_shape(rng: random.Random, full: tuple[int, ...], keep_last: bool = False):
    """A random shape that broadcasts to `full`: its last r dims, each either full or 1."""
    rank = rng.randint(1, len(full))
    shape = [n if rng.random() < 0.5 else 1 for n in full[len(full) - rank :]]
    if keep_last:
        shape[-1] = full[-1]
    return tuple(shape)


def draw_case(seed: int) -> dict:
    """One random call: tensors, the keyword arguments, and what to differentiate."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    batch = rng.choice([(), (1,), (2,), (2, 3)])
    h, hkv = rng.choice(HEADS)
    lq, lk = rng.choice([1, 2, 5, 9, 17, 23]), rng.choice([1, 3, 7, 16, 19])
    d, dv = rng.choice([1, 3, 8]), rng.choice([1, 5])
    q = torch.randn(*batch, h, lq, d, generator=gen, **F64)
    k = torch.randn(*batch, hkv, lk, d, generator=gen, **F64)
    v = torch.randn(*batch, hkv, lk, dv, generator=gen, **F64)
    if rng.random() < 0.2:  # a NaN key row: exactly the rows that see it become NaN
        k[(*(0 for _ in batch), rng.randrange(hkv), rng.randrange(lk), 0)] = float("nan")
    params = [q, k, v]
    call = dict(
        is_causal=rng.random() < 0.4, normalization=rng.choice(NORMALIZATIONS), enable_gqa=hkv != h
    )
    full = (*batch, h, lq, lk)
    kind = rng.choice(["bool", "bool", "float", None])
    if kind is not None:
        shape = _broadcast_shape(rng, full)
        if kind == "bool":
            call["attn_mask"] = torch.rand(shape, generator=gen) < rng.choice([1.0, 0.7, 0.3])
        else:
            mask = torch.randn(shape, generator=gen, **F64)
            mask = mask.masked_fill(torch.rand(shape, generator=gen) < 0.2, float("-inf"))
            call["attn_mask"] = mask.requires_grad_()
            params.append(call["attn_mask"])
    if rng.random() < 0.6:
        shape = _broadcast_shape(rng, (*batch, lk))
        call["key_padding_mask"] = torch.rand(shape, generator=gen) < rng.choice([0.0, 0.3, 0.8])
    if rng.random() < 0.5:  # a bias broadcast over some dims
        bias = torch.randn(_broadcast_shape(rng, full), generator=gen, **F64).requires_grad_()
        call["bias"] = bias
        params.append(bias)
    gate_kind = rng.choice([None, None, "toeplitz", "relation"])
    if gate_kind == "toeplitz":
        table = (1 + 0.3 * torch.randn(h, 9, generator=gen, **F64)).requires_grad_()
        call["gate"] = Toeplitz(table)
        params.append(table)
    elif gate_kind == "relation":
        table = (1 + 0.3 * torch.randn(1, 4, generator=gen, **F64)).requires_grad_()
        call["gate"] = Relation(table, torch.randint(0, 4, (lq, lk), generator=gen))
        params.append(table)
    if call["normalization"] == "exp":
        call["scale"] = 0.1  # exp has no denominator: keep the logits small
    for t in (q, k, v):
        t.requires_grad_()
    return dict(qkv=(q, k, v), params=params, call=call, seed=seed)


def _without_gqa(call: dict) -> dict:
    """The call for the functions that always allow grouped queries (no enable_gqa)."""
    return {name: value for name, value in call.items() if name != "enable_gqa"}


def _lifted_flex(q, k, v, **call):
    """The "flex" backend as `urpe.attention` runs it, with PyTorch's CPU-backward refusal lifted
    (see test_flex)."""
    check = flex_module._validate_device
    flex_module._validate_device = lambda *args: None
    try:
        spec = resolve(q, k, v, **call)
        out = execute(lambda s: flex_run(s, flex_module.flex_attention), spec)
    finally:
        flex_module._validate_device = check
    return out


# backend name -> the call (small tiles, so that a call spans several of them)
RUNNERS = {
    "reference": lambda *a, **c: attention(*a, **c, backend="reference"),
    "sdpa": lambda *a, **c: attention(*a, **c, backend="sdpa"),
    "blockwise": lambda *a, **c: blockwise_attention(*a, **c, block_q=4, block_k=8),
    "cpp": lambda *a, **c: cpp_attention(*a, **c, block_q=4, block_k=8),
    "auto": lambda *a, **c: attention(*a, **c),
    "triton": lambda *a, **c: attention(*a, **c, backend="triton"),
    "flex": _lifted_flex,
}


def _runs(name: str, case: dict) -> bool:
    """Whether backend `name` takes this call (the others say why they cannot)."""
    q, k, v = case["qkv"]
    call = case["call"]
    if name in ("reference", "auto", "blockwise"):
        return True
    if name == "cpp":
        return cpp_unavailable() is None
    if name == "triton":
        return triton_unsupported(q, k, v, **_without_gqa(call)) is None
    spec = resolve(q, k, v, **call)
    if name == "flex":
        return flex_spec_unsupported(spec, cpu_backward=False) is None
    from urpe.kernels import BACKENDS

    return BACKENDS[name].refusal(spec) is None


def _outputs_and_grads(fn, case: dict):
    out = fn(*case["qkv"], **case["call"])
    weight = torch.linspace(-1, 1, out.numel(), **F64).view_as(out)
    # rows the non-finite rule makes NaN pass no gradient: leave them out of the loss
    loss = (torch.where(torch.isnan(out), 0.0, out) * weight).sum()
    grads = torch.autograd.grad(loss, case["params"], allow_unused=True)
    return out, grads


def check_case(case: dict, backends) -> list[str]:
    """Names of the backends that ran this case (each checked against the reference)."""
    want_out, want_grads = _outputs_and_grads(RUNNERS["reference"], case)
    ran = []
    for name in backends:
        if not _runs(name, case):
            continue
        out, grads = _outputs_and_grads(RUNNERS[name], case)
        where = f"backend {name}, case seed {case['seed']}: {_describe(case)}"
        for what, got, want in [
            ("output", out, want_out),
            *(
                (f"gradient {i}", g, w)
                for i, (g, w) in enumerate(zip(grads, want_grads, strict=True))
            ),
        ]:
            if got is None and want is None:  # an input that the output does not depend on
                continue
            got = torch.zeros_like(want) if got is None else got
            want = torch.zeros_like(got) if want is None else want
            torch.testing.assert_close(
                got,
                want,
                atol=1e-10,
                rtol=1e-8,
                equal_nan=True,
                msg=lambda m, w=f"{what}, {where}": f"{w}\n{m}",
            )
        ran.append(name)
    return ran


def _describe(case: dict) -> str:
    q, k, _ = case["qkv"]
    shapes = {name: tuple(t.shape) for name, t in case["call"].items() if torch.is_tensor(t)}
    flags = {n: case["call"].get(n) for n in ("is_causal", "normalization", "enable_gqa")}
    return f"q {tuple(q.shape)}, k {tuple(k.shape)}, {shapes}, {flags}"


def _interpreted_programs(case: dict) -> int:
    """Tiles of 16 x 16 per (batch, head) that Triton's interpreter walks: its cost."""
    q, k, _ = case["qkv"]
    *_, lq, _ = q.shape
    rows = math.prod(q.shape[:-2])
    return rows * -(-lq // 16) * -(-k.shape[-2] // 16)


def _backends(case: dict, interpreted_limit: int, flex: bool) -> list[str]:
    """The backends to compare on this case: every native CPU one and "auto"; Triton under its
    interpreter and FlexAttention (eager on the CPU, about a second per new shape) as the
    time allows."""
    names = [n for n in native_backends("cpu") if n != "reference"] + ["auto"]
    if _interpreted_programs(case) <= interpreted_limit:
        names.append("triton")
    return names + ["flex"] if flex else names


def _sweep(seeds, interpreted_limit: int, flex_cases: int) -> dict[str, int]:
    """Check each seed's case; how many cases each backend ran."""
    ran: dict[str, int] = {}
    for seed in seeds:
        case = draw_case(seed)
        flex = ran.get("flex", 0) < flex_cases
        for name in check_case(case, _backends(case, interpreted_limit, flex)):
            ran[name] = ran.get(name, 0) + 1
    return ran


# ---------------------------------------------------------------------------------------------
# The cases the issue names


@pytest.mark.parametrize("backend", ["blockwise", "cpp", "auto", "triton"])
@pytest.mark.parametrize("mask_shape", [(5, 1), (1, 1), (2, 1, 1), (1, 2, 5, 1)])
def test_relu2_with_a_mask_broadcast_over_keys_matches_the_reference(backend, mask_shape):
    """relu2 divides by the keys a query sees: an all-True mask of key dim 1 sees all Lk."""
    if backend == "cpp" and cpp_unavailable() is not None:
        pytest.skip(cpp_unavailable())
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 2, 5, 8, generator=gen, **F64).requires_grad_()
    k = torch.randn(1, 2, 7, 8, generator=gen, **F64).requires_grad_()
    v = torch.randn(1, 2, 7, 3, generator=gen, **F64).requires_grad_()
    mask = torch.ones(mask_shape, dtype=torch.bool)
    case = dict(
        qkv=(q, k, v), params=[q, k, v], seed=None, call=dict(attn_mask=mask, normalization="relu2")
    )
    assert check_case(case, [backend]) == [backend]
    # the all-True mask is no mask at all
    unmasked = reference_attention(q, k, v, normalization="relu2")
    torch.testing.assert_close(RUNNERS[backend](q, k, v, **case["call"]), unmasked)


@pytest.mark.parametrize(
    ("mask_shape", "padding_shape"),
    [
        ((7, 1), None),
        ((1, 11), None),
        ((2, 1, 1), None),
        ((3, 1, 1, 1), None),
        ((1,), (3, 11)),
        ((7, 1), (1, 11)),
        ((1, 1, 7, 1), (11,)),
    ],
)
@pytest.mark.parametrize("causal", [False, True])
def test_visible_key_counts_count_the_keys_a_broadcast_mask_stands_for(
    mask_shape, padding_shape, causal
):
    gen = torch.Generator().manual_seed(2)
    b, h, lq, lk = 3, 2, 7, 11
    mask = torch.rand(mask_shape, generator=gen) < 0.6
    padding = None if padding_shape is None else torch.rand(padding_shape, generator=gen) < 0.3
    q = torch.zeros(b, h, lq, 1)
    k = torch.zeros(b, h, lk, 1)
    spec = resolve(q, k, k, attn_mask=mask, key_padding_mask=padding, is_causal=causal)
    counts = visible_key_counts(spec.key_padding_mask, spec.attn_mask, causal, lq, lk)
    dense = torch.ones(b, h, lq, lk, dtype=torch.bool) & mask
    if padding is not None:
        dense = dense & ~padding[..., None, None, :]
    if causal:
        dense = dense & torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)
    torch.testing.assert_close(counts.expand(b, h, lq), dense.sum(-1))


# ---------------------------------------------------------------------------------------------
# The randomized sweep


@pytest.mark.slow
def test_random_broadcast_masks_agree_on_every_backend():
    """24 random calls on every CPU backend, the cheaper half under Triton's interpreter, two
    through FlexAttention (about 10 s in all)."""
    ran = _sweep(range(24), interpreted_limit=3, flex_cases=2)
    # every backend met a good share of the cases (none was silently skipped throughout)
    assert set(_backends(draw_case(0), 10**9, flex=True)) == set(ran), ran
    assert ran["blockwise"] == ran["auto"] == ran.get("cpp", 24) == 24 and ran["triton"] >= 6, ran


@pytest.mark.slow
@pytest.mark.parametrize("block", range(4))
def test_random_broadcast_masks_agree_on_every_backend_wide(block):
    """200 more calls, Triton and FlexAttention on most of them (minutes)."""
    ran = _sweep(range(1000 + 50 * block, 1050 + 50 * block), interpreted_limit=24, flex_cases=50)
    assert ran["triton"] >= 25 and ran["flex"] >= 10, ran
