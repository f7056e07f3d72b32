"""The C++ CPU kernel (backend "cpp") against the reference, the specification, in float64.

What is particular to it (the shared grid of cases, with small tiles, is in
test_backend_conformance.py): the default tiles and tile sizes; the dropout mask it shares with
the reference; the work split over threads (query ranges with their own dK/dV, dense gradients
that broadcast kept in one work item); its exp; and what happens where it cannot be built (one
warning, "auto" runs the eager kernel, nothing fails).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import subprocess
import sys

import pytest
import torch

from urpe.kernels import Relation, Toeplitz, attention, reference_attention, select_backend
from urpe.kernels.cpp import FEW_QUERIES, build, cpp_attention, unavailable
from urpe.kernels.cpp.arguments import IN_PLACE_LENGTH

from .kernel_cases import (
    NORMALIZATIONS,
    SMALL_TILES,
    TERMS,
    assert_close,
    case,
    check_against_reference,
    outputs_and_grads,
)

pytestmark = pytest.mark.skipif(
    unavailable() is not None, reason=f"the C++ kernel is unavailable: {unavailable()}"
)
F64 = dict(dtype=torch.float64)


def _cpp(**tiles):
    return lambda *a, **c: cpp_attention(*a, **c, **tiles)


@pytest.mark.parametrize("normalization", NORMALIZATIONS)
@pytest.mark.parametrize("terms", TERMS[1:4], ids=lambda t: f"{t[0]}-{t[1]}")
def test_default_tiles_match_reference(normalization, terms):
    check_against_reference(
        cpp_attention, (2, 3, 70, 600, 16), "causal+padding", terms, normalization
    )


def test_dropout_is_the_reference_dropout():
    """The keep decision hashes (seed, flat index) as the reference does: the same seed gives
    the same mask, so output and gradients equal the reference's with dropout on."""
    qkv, params, call = case((2, 3, 24, 40, 16), "causal+padding", "toeplitz", "relation")
    call |= dict(dropout_p=0.3, dropout_seed=11)
    want = outputs_and_grads(reference_attention, qkv, params, call)
    assert_close(outputs_and_grads(_cpp(**SMALL_TILES), qkv, params, call), want)
    q, k, v = qkv
    eye = torch.eye(40, **F64).expand(2, 3, 40, 40)
    with torch.no_grad():  # v = identity: the weights themselves, a quarter-ish of them dropped
        dropped = cpp_attention(q, k, eye, **call)
        kept = reference_attention(q, k, eye, **(call | dict(dropout_p=0.0)))
    visible = kept != 0
    rate = 1 - (dropped[visible] != 0).double().mean().item()
    assert abs(rate - 0.3) < 0.05, rate
    with torch.no_grad():  # without a seed, torch's generator draws one
        call.pop("dropout_seed")
        torch.manual_seed(5)
        first = cpp_attention(q, k, v, **call)
        torch.manual_seed(5)
        again = cpp_attention(q, k, v, **call)
        other = cpp_attention(q, k, v, **call)
    assert torch.equal(first, again) and not torch.equal(first, other)


def test_grouped_queries_and_dense_gradients_that_broadcast():
    """Dense terms whose gradients broadcast over batch, heads or rows keep those dims in one
    work item (so no two write one entry); GQA sums dK, dV over the query heads of a group."""
    gen = torch.Generator().manual_seed(3)
    b, h, hkv, lq, lk, d = 3, 4, 2, 21, 33, 8
    q = torch.randn(b, h, lq, d, generator=gen, **F64).requires_grad_()
    k = torch.randn(b, hkv, lk, d, generator=gen, **F64).requires_grad_()
    v = torch.randn(b, hkv, lk, 5, generator=gen, **F64).requires_grad_()
    bias = torch.randn(1, 1, lq, lk, generator=gen, **F64).mul(0.5).requires_grad_()
    gate = torch.randn(b, h, 1, lk, generator=gen, **F64).mul(0.3).add(1).requires_grad_()
    mask = torch.randn(1, h, lq, lk, generator=gen, **F64).mul(0.2).requires_grad_()
    params = [q, k, v, bias, gate, mask]
    call = dict(bias=bias, gate=gate, attn_mask=mask, enable_gqa=True, is_causal=True)
    for norm in ("softmax", "relu2"):
        want = outputs_and_grads(
            reference_attention, (q, k, v), params, call | {"normalization": norm}
        )
        for tiles in (dict(block_q=4, block_k=8), {}):
            got = outputs_and_grads(
                _cpp(**tiles), (q, k, v), params, call | {"normalization": norm}
            )
            assert_close(got, want)


def test_query_ranges_with_their_own_key_gradients_over_threads():
    """One (batch, kv head) pair and many query blocks: the backward splits the query blocks
    into ranges, each with its own dK/dV copy; 1 and 2 threads agree with the reference."""
    qkv, params, call = case((1, 1, 300, 300, 16), "causal+padding", "toeplitz", "toeplitz")
    want = outputs_and_grads(reference_attention, qkv, params, call)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            got = outputs_and_grads(_cpp(block_q=8, block_k=32), qkv, params, call)
            assert_close(got, want)
    finally:
        torch.set_num_threads(before)


def test_decoding_steps_stay_on_one_thread_up_to_a_larger_size():
    """A call of few query rows runs on the calling thread up to 2^19 multiply-adds (a decoding
    step at Lk = 1024 with B = 1, H = 8, D = 32: two threads would save a third of it idle and
    stall 15x with another process on a core); longer ones split over threads as SDPA's do
    (issue 42: Lk = 1k-32k at D = 64 within 1.2x of SDPA); long rows from 2^18 on, as before."""
    workers = torch.ops.urpe_cpp.workers
    step = 1 * 8 * 1 * 1024 * (32 + 32)  # B * H * Lq * Lk * (D + Dv) = 2^19
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert workers(8, step, 1) == 1
        assert workers(8, step, 16) == 1  # up to 16 query rows
        assert workers(8, 2 * step, 1) == 2  # Lk = 2048 (1024 at D = 64): threads pay again
        assert workers(8, step, 17) == 2  # more rows: the old threshold
        assert workers(64, 2**18, 24) == 1  # a short row's call, as before
        assert workers(64, 2**18 + 1, 24) == 2
        assert workers(1, 4 * step, 1) == 1  # one item
        torch.set_num_threads(1)
        assert workers(8, 4 * step, 1) == 1
    finally:
        torch.set_num_threads(before)
    q = torch.randn(1, 8, 1, 32, **F64)
    k, v = torch.randn(1, 8, 1024, 32, **F64), torch.randn(1, 8, 1024, 32, **F64)
    gate = Toeplitz(torch.rand(8, 2047, **F64) + 0.5)
    want = reference_attention(q, k, v, gate=gate, is_causal=True)
    torch.testing.assert_close(attention(q, k, v, gate=gate, is_causal=True, backend="cpp"), want)


def test_strided_and_broadcast_inputs():
    """Views (transposed q, expanded terms with zero strides, a shared relation index) read as
    they are."""
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(2, 9, 3, 8, generator=gen, **F64).transpose(1, 2).requires_grad_()
    k = torch.randn(2, 3, 12, 8, generator=gen, **F64).requires_grad_()
    v = torch.randn(2, 3, 12, 4, generator=gen, **F64).requires_grad_()
    row = torch.randn(1, 1, 1, 12, generator=gen, **F64)
    index = torch.randint(0, 5, (12,), generator=gen).expand(9, 12)  # zero stride over queries
    table = torch.randn(3, 5, generator=gen, **F64).requires_grad_()
    call = dict(bias=row.expand(2, 3, 9, 12), gate=Relation(table, index))
    params = [q, k, v, table]
    want = outputs_and_grads(reference_attention, (q, k, v), params, call)
    assert_close(outputs_and_grads(_cpp(block_q=4, block_k=5), (q, k, v), params, call), want)


@pytest.mark.parametrize(
    "length, tiles, in_place",
    [(6, {}, True), (9, dict(block_q=2, block_k=4), True), (IN_PLACE_LENGTH + 3, {}, False)],
)
def test_views_of_projections_are_read_and_differentiated_in_place(length, tiles, in_place):
    """q, k, v as a training step's projections give them, views of (B, L, H, D) (grouped: k
    and v with fewer heads): a short call reads them where they lie and writes their gradients
    in that layout, and reads dO in the layout a (B, L, H * D) reshape gives back, so neither
    pass copies a (B, H, L, D) tensor; a long one copies them (rows a stride apart cost more
    there). Forward and backward agree with the reference either way. (A table's gradient may
    be copied: a (H, 2L - 1) view of the kernel's padded rows, taken by autograd.)"""
    from torch.profiler import ProfilerActivity, profile

    b, h, hkv, d = 2, 4, 2, 4
    gen = torch.Generator().manual_seed(7)
    widths = (h * d, hkv * d, hkv * d)
    projections = [torch.randn(b, length, w, generator=gen, **F64) for w in widths]
    tables = [torch.randn(h, 2 * length - 1, generator=gen, **F64) for _ in range(2)]
    grad = torch.randn(b, length, h, d, generator=gen, **F64).transpose(1, 2)  # a (B, H, L, D) view

    def step(run, watch: bool = False):
        leaves = [t.clone().requires_grad_() for t in (*projections, *tables)]
        q, k, v = (t.view(b, length, -1, d).transpose(1, 2) for t in leaves[:3])
        terms = dict(bias=Toeplitz(leaves[3]), gate=Toeplitz(leaves[4]), is_causal=True)
        watching = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
        with watching if watch else contextlib.nullcontext() as p:
            out = run(q, k, v, enable_gqa=True, **terms)
            out.backward(grad)
        copied = watch and any(
            e.name in ("aten::copy_", "aten::clone") and len(e.input_shapes[0]) == 4
            for e in p.events()
        )
        return [out.detach(), *(t.grad for t in leaves)], copied

    want, _ = step(reference_attention)
    got, copied = step(_cpp(**tiles), watch=True)
    assert copied is not in_place
    for got_tensor, want_tensor in zip(got, want, strict=True):
        torch.testing.assert_close(got_tensor, want_tensor)


def test_exp_is_within_one_ulp():
    """The tile loops' float32 exp: exact at -inf, inf and nan, within one ulp (float32's eps,
    relative) of the exact value over the range where float32 has normal results, 0 beneath
    it; float64 uses the C library's exp."""
    x = torch.cat(
        [
            torch.linspace(-87.3, 88.7, 200_001),
            torch.tensor([0.0, -0.0, 1e-30, -1e-30, 88.72, -87.33]),
        ]
    )
    got = torch.ops.urpe_cpp.exp_values(x).double()
    want = torch.exp(x.double())
    ulp = torch.finfo(torch.float32).eps * want
    assert ((got - want).abs() <= ulp).all(), ((got - want).abs() / ulp).max()
    special = torch.tensor([float("-inf"), float("inf"), float("nan"), -100.0, 100.0])
    got = torch.ops.urpe_cpp.exp_values(special)
    assert got[0] == 0 and got[1] == math.inf and got[2].isnan() and got[3] == 0
    assert got[4] == math.inf
    exact = torch.exp(x.double())
    torch.testing.assert_close(torch.ops.urpe_cpp.exp_values(x.double()), exact, rtol=1e-15, atol=0)


def test_auto_picks_cpp_on_the_cpu_and_sdpa_for_plain_softmax_beyond_a_few_queries():
    q = torch.randn(1, 2, 8, 16)
    table = Toeplitz(torch.ones(2, 5))
    assert select_backend("auto", q, q, q, gate=table).name == "cpp"
    assert select_backend("auto", q, q, q, bias=table, normalization="l2").name == "cpp"
    long = torch.randn(1, 2, FEW_QUERIES + 1, 16)
    assert select_backend("auto", long, long, long).name == "sdpa"
    # a few queries (decoding): one C++ call, which also checks for NaN/inf, beats SDPA + check
    assert select_backend("auto", q, q, q).name == "cpp"
    torch.testing.assert_close(
        attention(q, q, q, gate=table, bias=table),
        reference_attention(q, q, q, gate=table, bias=table),
    )


def test_a_normalization_registered_later_is_left_to_blockwise():
    from urpe.kernels import NORMALIZATIONS as REGISTERED
    from urpe.kernels import register_normalization, registered

    twin = dataclasses.replace(REGISTERED["softmax"], name="softmax-twin")
    q = torch.randn(1, 2, 8, 16)
    call = dict(gate=Toeplitz(torch.ones(2, 5)), normalization="softmax-twin")
    with registered(register_normalization, twin):
        assert select_backend("auto", q, q, q, **call).name == "blockwise"
        with pytest.raises(ValueError, match="'softmax-twin' has no form in the C\\+\\+ kernel"):
            attention(q, q, q, **call, backend="cpp")


def test_the_build_key_follows_sources_flags_and_machine():
    flags = build.compile_flags()
    assert build.build_key(flags) == build.build_key(list(flags))
    assert build.build_key(flags) != build.build_key(build.compile_flags(native=False))
    assert "-O3" in flags and not any("fast-math" in f for f in flags)


# ---------------------------------------------------------------------------------------------
# Where it cannot be built: one warning, "auto" runs blockwise, backend="cpp" says why.

_WITHOUT_IT = """
import warnings, torch
from urpe.kernels import Toeplitz, attention, reference_attention, select_backend
q = torch.randn(1, 2, 6, 4, dtype=torch.float64)
table = Toeplitz(torch.ones(2, 3, dtype=torch.float64))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    names = [select_backend("auto", q, q, q, gate=table).name for _ in range(3)]
    out = attention(q, q, q, gate=table)
    out = attention(q, q, q, gate=table)
torch.testing.assert_close(out, reference_attention(q, q, q, gate=table))
try:
    attention(q, q, q, gate=table, backend="cpp")
    raise SystemExit("backend='cpp' ran")
except ValueError as error:
    print("REFUSED", error)
print("NAMES", names)
print("WARNINGS", [str(w.message) for w in caught if "C++" in str(w.message)])
"""


def _run_without(env_changes: dict, tmp_path) -> str:
    env = dict(
        os.environ, URPE_CACHE_DIR=str(tmp_path / "cache"), URPE_KERNEL_CACHE_DIR="", **env_changes
    )
    result = subprocess.run(
        [sys.executable, "-c", _WITHOUT_IT], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def test_without_a_compiler_auto_warns_once_and_runs_blockwise(tmp_path):
    out = _run_without({"CXX": str(tmp_path / "no-such-compiler")}, tmp_path)
    assert "NAMES ['blockwise', 'blockwise', 'blockwise']" in out
    warnings_line = next(line for line in out.splitlines() if line.startswith("WARNINGS"))
    assert warnings_line.count("unavailable") == 1 and "no C++ compiler" in warnings_line
    assert "REFUSED" in out and "no C++ compiler" in out
    assert not (tmp_path / "cache" / "cpp-kernel").exists()  # nothing half-built left behind


def test_switched_off_it_stays_quiet_and_auto_runs_blockwise(tmp_path):
    out = _run_without({build.SWITCH: "0"}, tmp_path)
    assert "NAMES ['blockwise', 'blockwise', 'blockwise']" in out and "WARNINGS []" in out
    assert f"switched off with {build.SWITCH}=0" in out


def test_another_process_loads_the_built_library_without_compiling():
    code = "from urpe.kernels.cpp import unavailable; print('LOADED', unavailable() is None)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
    )
    assert "LOADED True" in result.stdout, result.stderr[-2000:]
    assert "compiling" not in result.stderr


def test_builds_are_tried_from_tuned_to_plain_and_the_first_error_is_reported(monkeypatch):
    tried = []

    def failing(flags):
        tried.append(flags)
        raise RuntimeError(f"Error building extension\ncompiler said no to {flags[1]}")

    monkeypatch.setattr(build, "_state", {})
    monkeypatch.setattr(build, "_load_packaged", lambda: "")  # none packaged, none cached
    monkeypatch.setattr(build, "_load_cached", lambda flags: "")
    monkeypatch.setattr(build, "_missing_tools", lambda: None)
    monkeypatch.setattr(build, "_build_and_load", failing)
    with pytest.warns(RuntimeWarning, match="compiler said no to -fopenmp"):
        reason = build.load()
    assert reason == "the build failed: RuntimeError: compiler said no to -fopenmp"
    assert tried == [build.compile_flags(**b) for b in build.BUILDS]
    assert "-march=native" in " ".join(tried[0]) and "-fopenmp" not in tried[-1]
    assert build.load() == reason  # decided once per process
    monkeypatch.setattr(build, "_state", {})
    monkeypatch.setattr(build, "_build_and_load", lambda flags: tried.append(flags))
    assert build.load() is None and tried[-1] == build.compile_flags(**build.BUILDS[0])


def test_a_build_without_openmp_leaves_auto_to_blockwise_but_runs_by_name(monkeypatch):
    import urpe.kernels.cpp as cpp

    monkeypatch.setattr(cpp, "threaded", lambda: False)
    q = torch.randn(1, 2, 8, 16, **F64)
    table = Toeplitz(torch.ones(2, 5, **F64))
    assert select_backend("auto", q, q, q, gate=table).name == "blockwise"
    want = reference_attention(q, q, q, gate=table)
    torch.testing.assert_close(attention(q, q, q, gate=table, backend="cpp"), want)


@pytest.mark.slow
def test_the_plain_build_without_openmp_is_correct_on_one_thread(tmp_path):
    """The last build tried (no -march=native, no OpenMP), built for real in a fresh cache."""
    code = """
import torch
from urpe.kernels.cpp import build
build.BUILDS = (build.BUILDS[-1],)
from urpe.kernels import Toeplitz, attention, reference_attention, select_backend
assert build.unavailable() is None and not build.threaded()
q = torch.randn(2, 3, 40, 8, dtype=torch.float64)
gate = Toeplitz(torch.rand(3, 21, dtype=torch.float64) + 0.5)
assert select_backend("auto", q, q, q, gate=gate).name == "blockwise"
got = attention(q, q, q, gate=gate, is_causal=True, backend="cpp")
torch.testing.assert_close(got, reference_attention(q, q, q, gate=gate, is_causal=True))
print("PLAIN OK")
"""
    env = dict(os.environ, URPE_CACHE_DIR=str(tmp_path), URPE_KERNEL_CACHE_DIR="")
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600
    )
    assert "PLAIN OK" in result.stdout, result.stderr[-3000:]


def test_deterministic_mode_gives_the_same_table_gradients_on_every_run():
    qkv, params, call = case((2, 3, 200, 200, 16), "causal", "toeplitz", "relation")
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        runs = [outputs_and_grads(_cpp(block_q=8, block_k=32), qkv, params, call) for _ in range(3)]
    finally:
        torch.use_deterministic_algorithms(before)
    for out, grads in runs[1:]:
        assert torch.equal(out, runs[0][0])
        assert all(torch.equal(g, g0) for g, g0 in zip(grads, runs[0][1], strict=True))
    assert_close(runs[0], outputs_and_grads(reference_attention, qkv, params, call))


def test_the_build_command_says_whether_the_kernel_loads(monkeypatch, capsys):
    assert build.main([]) == 0
    assert "the C++ kernel is ready (" in capsys.readouterr().out
    monkeypatch.setattr(build, "_state", {"reason": "no C++ compiler", "error": "cc: not found"})
    assert build.main([]) == 1
    err = capsys.readouterr().err
    assert "unavailable: no C++ compiler" in err and "cc: not found" in err
