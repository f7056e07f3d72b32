"""Term kinds (`urpe.kernels.terms`): one class each, the codes the compiled kernels read, and a
kind defined outside the package that runs wherever the guide says it does."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from torch import Tensor

import urpe
from urpe.kernels import (
    BACKENDS,
    TERM_KINDS,
    CallShape,
    CrossDecay,
    Decay,
    Dense,
    Documents,
    Relation,
    Term,
    Toeplitz,
    attention,
    register_term_kind,
    relative_offsets,
)
from urpe.kernels.term_shapes import ANY_LENGTH

F64 = dict(dtype=torch.float64)
KERNELS = Path(urpe.__file__).parent / "kernels"


def _cpp_kind_enum() -> dict[str, int]:
    """terms.h's `enum Kind` as {name: value}."""
    text = (KERNELS / "cpp" / "terms.h").read_text()
    body = re.search(r"enum Kind : int64_t \{([^}]*)\}", text).group(1)
    codes, value = {}, -1
    for entry in body.split(","):
        name, _, given = entry.strip().partition("=")
        value = int(given) if given.strip() else value + 1
        codes[name.strip()] = value
    return codes


def test_each_built_in_kind_has_the_code_the_compiled_kernels_read():
    cpp = _cpp_kind_enum()
    expected = {
        "dense": "kDense",
        "toeplitz": "kToeplitz",
        "relation": "kRelation",
        "decay": "kDecay",
        "cross_decay": "kCrossDecay",
    }
    for kind, name in expected.items():
        assert TERM_KINDS[kind].code == cpp[name], kind
    assert cpp["kNone"] == 0
    from urpe.kernels.cpp.arguments import KIND_CODES, NO_TERM, TABLE_IN_PLACE

    assert NO_TERM == 0 and TABLE_IN_PLACE == cpp["kToeplitzTable"]
    assert {k: v for k, v in KIND_CODES.items() if k != "none"} == {
        k: TERM_KINDS[k].code for k in expected
    }


def test_the_triton_kernels_read_the_same_codes():
    pytest.importorskip("triton")
    from urpe.kernels.triton import tiles

    assert tiles.NO_TERM.value == 0
    for kind, constant in (
        ("dense", tiles.DENSE),
        ("toeplitz", tiles.TOEPLITZ),
        ("relation", tiles.RELATION),
        ("decay", tiles.DECAY),
    ):
        assert TERM_KINDS[kind].code == constant.value


def _built_in_terms(lq=3, lk=5, heads=2):
    gen = torch.Generator().manual_seed(0)
    return {
        "dense": Dense(torch.randn(2, heads, lq, lk, generator=gen, **F64)),
        "toeplitz": Toeplitz(torch.randn(heads, 9, generator=gen, **F64)),
        "relation": Relation(
            torch.randn(heads, 4, generator=gen, **F64), torch.randint(0, 4, (2, lq, lk))
        ),
        "decay": Decay(-torch.rand(2, heads, lk, generator=gen, **F64)),
        "cross_decay": CrossDecay(torch.randn(2, heads, lq + lk, generator=gen, **F64)),
        "documents": Documents((torch.arange(lk) // 2).repeat(2, 1)),
    }


@pytest.mark.parametrize("kind", list(_built_in_terms()))
def test_a_terms_raw_layout_goes_there_and_back(kind):
    term = _built_in_terms()[kind]
    assert type(term) is TERM_KINDS[kind] and term.kind == kind
    back = TERM_KINDS[kind].from_raw(*term.raw())
    torch.testing.assert_close(back.dense(3, 5), term.dense(3, 5))


@pytest.mark.parametrize("kind", list(_built_in_terms()))
def test_a_terms_signature_leaves_out_the_keys_length_only(kind):
    at_5 = _built_in_terms(lk=5)[kind].signature(5)
    at_6 = _built_in_terms(lk=6)[kind].signature(6)
    assert at_5 == at_6
    if kind != "toeplitz":  # a table's width is a number of offsets, never the keys' length
        assert ANY_LENGTH in repr(at_5)


def test_each_kind_refuses_a_role_it_cannot_play():
    q = k = v = torch.zeros(1, 2, 3, 4)
    with pytest.raises(TypeError, match="urpe.Decay is a bias"):
        attention(q, k, v, gate=Decay(torch.zeros(1, 2, 3)))
    with pytest.raises(TypeError, match="a Documents term is a document_ids, not a bias"):
        attention(q, k, v, bias=Documents(torch.zeros(1, 3, dtype=torch.long)))


# ---------------------------------------------------------------------------------------------
# A kind defined outside the package (as the attention guide's "Adding a term kind" shows)


@dataclass(frozen=True)
class LinearDistance(Term):
    """b_ij = s_h (j - pos(i)) with a learnable slope per head (ALiBi with a signed slope)."""

    kind: ClassVar[str] = "linear_distance_test"
    slopes: Tensor  # (H,)

    def check(self, role: str, call: CallShape) -> None:
        if self.slopes.shape != (call.heads,):
            raise ValueError(f"{role} slopes must have shape ({call.heads},)")

    def dense(self, lq: int, lk: int) -> Tensor:
        offsets = relative_offsets(lq, lk, self.slopes.device).to(self.slopes.dtype)
        return (self.slopes[:, None, None] * offsets)[None]  # (1, H, Lq, Lk)


@pytest.fixture
def linear_distance():
    register_term_kind(LinearDistance)
    yield LinearDistance
    TERM_KINDS.pop(LinearDistance.kind)


EAGER = ("reference", "blockwise", "sdpa")
COMPILED = ("cpp", "triton", "flex")


@pytest.mark.parametrize("role", ["bias", "gate"])
@pytest.mark.parametrize("backend", EAGER)
def test_a_new_kind_runs_on_the_eager_backends_as_its_dense_form(linear_distance, backend, role):
    if backend == "sdpa" and role == "gate":
        pytest.skip("SDPA has no gate")
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 3, n, 8, generator=gen, **F64) for n in (5, 7, 7))
    q.requires_grad_()
    slopes = torch.tensor([0.3, -0.2, 0.1], **F64, requires_grad=True)
    term = linear_distance(slopes)
    out = attention(q, k, v, **{role: term}, is_causal=True, backend=backend)
    dense = term.dense(5, 7)
    expected = attention(q, k, v, **{role: dense}, is_causal=True, backend="reference")
    torch.testing.assert_close(out, expected)
    grads = torch.autograd.grad(out.square().sum(), (q, slopes))
    wanted = torch.autograd.grad(expected.square().sum(), (q, slopes))
    for got, want in zip(grads, wanted, strict=True):
        torch.testing.assert_close(got, want)
    # the reference's gradient of the dense form is the slopes' own by the chain rule
    assert wanted[1].abs().sum() > 0


@pytest.mark.parametrize("backend", COMPILED)
def test_the_compiled_backends_refuse_a_new_kind_by_name(linear_distance, backend):
    q = k = v = torch.zeros(1, 3, 4, 8, **F64)
    term = linear_distance(torch.zeros(3, **F64))
    refusal = f"backend '{backend}' cannot run this call: .* not linear_distance_test"
    for role in ("bias", "gate"):
        with pytest.raises(ValueError, match=refusal):
            attention(q, k, v, **{role: term}, backend=backend)


def test_auto_runs_a_new_kind_on_a_backend_that_takes_it(linear_distance):
    q, k, v = (torch.randn(1, 3, 4, 8, **F64) for _ in range(3))
    term = linear_distance(torch.tensor([0.1, 0.2, 0.3], **F64))
    out = attention(q, k, v, gate=term)
    torch.testing.assert_close(out, attention(q, k, v, gate=term.dense(4, 4), backend="reference"))
    for name in ("cpp", "triton", "flex"):
        assert not BACKENDS[name].capabilities.takes("gate", "linear_distance_test")
    for name in ("reference", "blockwise"):
        assert BACKENDS[name].capabilities.takes("gate", "linear_distance_test")


def test_a_kind_needs_a_name_and_may_not_replace_a_built_in_one():
    with pytest.raises(TypeError, match="subclass of urpe.kernels.Term"):
        register_term_kind(int)

    @dataclass(frozen=True)
    class Impostor(Term):
        kind: ClassVar[str] = "toeplitz"

    with pytest.raises(ValueError, match="built in"):
        register_term_kind(Impostor)
