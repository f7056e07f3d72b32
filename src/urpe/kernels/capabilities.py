"""What a backend can run, declared once beside it as a `Capabilities` table.

Dispatch reads the table (a call the table refuses is skipped by "auto" and refused, with the
table's reason, when the backend is named), and so does the backend's own entry point
(`cpp_attention`, `triton_attention`, `flex_urpe_attention`): one declaration, one check.

Normalisations are compared by identity, not by name: a kernel with compiled formulas was
written for the registry's entries as they were when it was imported. A normalisation registered
again under the same name with other formulas is a different object, so such a kernel refuses
it, and "auto" moves on to a backend that reads the registry's formulas (the blockwise kernel,
the reference).

What a table cannot say (a kernel that failed to build, an interpreter switched off, a counter's
range) stays in the backend's own `unsupported`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .host import dual_tensors
from .normalization import NORMALIZATIONS, Normalization
from .spec import AttentionSpec
from .terms import TERM_KINDS

# The built-in kinds a compiled kernel has a form for; a kind registered later is refused by
# name by such a kernel. `ANY_KIND` (None): any kind, through its dense form where the backend
# has no own reader for it.
BIAS_KINDS = ("dense", "toeplitz", "relation", "decay")
GATE_KINDS = ("dense", "toeplitz", "relation")  # a Decay is a bias only (resolve says so)
ANY_KIND = None
DROPOUT = ("seeded", "unseeded", "none")


def built_in(*names: str) -> tuple[Normalization, ...]:
    """The registry's entries of these names, as they are now (at the backend's import: the
    formulas its kernel implements)."""
    return tuple(NORMALIZATIONS[name] for name in names)


@dataclass(frozen=True)
class Capabilities:
    """A backend's table. label: how its reasons name it ("the C++ kernel", "SDPA").

    normalizations: the entries it implements, compared by identity (None: every registered
        one, read from the registry when it runs).
    bias, gate: the term kinds it takes by name ("dense", "toeplitz", "relation"; a bias also
        "decay"), () for none, or `ANY_KIND` (None): every kind, a kind it has no reader for
        through the term's dense form (`urpe.kernels.Term`). Every backend runs
        `document_ids` (no entry).
    dtypes: the dtypes of q it takes (None: any that `urpe.attention` accepts).
    devices: the device types it is built for (None: any); `emulated`: where it also runs, as
        an emulation for its own tests (Triton's CPU interpreter). "auto" may still be told to
        defer those calls, and the tests and benchmark rows that sweep the registry leave them
        out.
    gradients: the device types where it has a backward pass (None: wherever it runs).
    dropout: "seeded" (honours dropout_seed), "unseeded" (draws its own mask), "none".
    max_head_dim: the largest head dim (of q and of v) it takes (None: no limit).
    finds_nonfinite: for a call that needs no gradient, and one with gradients in plain eager
        mode, `run` finds NaN/inf in q, k and v itself and returns None on meeting one (or
        applies the non-finite rule itself), so no pass over q, k and v runs before it
        (`nonfinite.guarded`).
    forward_ad: it gives forward-mode AD tangents (dual tensors, `torch.func.jvp`); without,
        a call with tangents is refused.
    """

    label: str
    normalizations: tuple[Normalization, ...] | None = None
    bias: tuple[str, ...] | None = BIAS_KINDS
    gate: tuple[str, ...] | None = GATE_KINDS
    dtypes: tuple[torch.dtype, ...] | None = None
    devices: tuple[str, ...] | None = None
    emulated: tuple[str, ...] = ()
    gradients: tuple[str, ...] | None = None
    dropout: str = "seeded"
    max_head_dim: int | None = None
    finds_nonfinite: bool = False
    forward_ad: bool = False

    def __post_init__(self) -> None:
        named = (*(self.bias or ()), *(self.gate or ()))
        unknown = [k for k in named if k not in TERM_KINDS]
        if unknown or self.dropout not in DROPOUT:
            raise ValueError(
                f"term kinds must be in {tuple(TERM_KINDS)} and dropout one of {DROPOUT}, got "
                f"{unknown or self.dropout!r}"
            )

    def takes(self, role: str, kind: str) -> bool:
        """Whether it runs a "bias" or "gate" of this term kind (`ANY_KIND`: every kind)."""
        kinds = self.bias if role == "bias" else self.gate
        return kinds is ANY_KIND or kind in kinds

    def implements(self, norm: Normalization) -> bool:
        return self.normalizations is None or any(norm is n for n in self.normalizations)

    def refuses(self, spec: AttentionSpec) -> str | None:
        """Why the table rules this call out, or None."""
        if not self.implements(spec.norm):
            return self._normalization_reason(spec.normalization)
        device = spec.q.device.type
        if self.devices is not None and device not in (*self.devices, *self.emulated):
            where = " or ".join(d.upper() for d in (*self.devices, *self.emulated))
            return f"{self.label} runs on {where} devices, not {device}"
        for role, kinds in (("bias", self.bias), ("gate", self.gate)):
            term = getattr(spec, role)
            if term is None or self.takes(role, term.kind):
                continue
            if not kinds:
                return f"{self.label} takes no {role}" + (
                    " (it has no post-normalisation gate)" if role == "gate" else ""
                )
            return f"{self.label} takes a {role} as {' or '.join(kinds)}, not {term.kind}"
        if self.dtypes is not None and spec.q.dtype not in self.dtypes:
            names = ", ".join(str(d).removeprefix("torch.") for d in self.dtypes)
            return f"dtype {spec.q.dtype} is not one of {names}"
        if self.max_head_dim is not None:
            if max(spec.head_dim, spec.value_dim) > self.max_head_dim:
                return (
                    f"{self.label} takes head dims up to {self.max_head_dim}, got "
                    f"D={spec.head_dim}, Dv={spec.value_dim}"
                )
        if spec.dropout_p > 0.0:
            if self.dropout == "none":
                return f"{self.label} has no dropout"
            if self.dropout == "unseeded" and spec.dropout_seed is not None:
                return f"{self.label} draws its own dropout mask and cannot take dropout_seed"
        if self.gradients is not None and device not in self.gradients and spec.records_grad:
            return f"{self.label} has no backward on the {device} (gradients are asked for)"
        if not self.forward_ad and dual_tensors(*spec.differentiable):
            return (
                f"{self.label} has no forward-mode AD (q, k, v or a term carry tangents); "
                "backend 'reference' gives them"
            )
        return None

    def _normalization_reason(self, name: str) -> str:
        names = [n.name for n in self.normalizations]
        if name in names:
            return (
                f"normalization {name!r} was registered again with other formulas; "
                f"{self.label} implements only the built-in one (backend 'blockwise' and the "
                "reference run the registry's formulas)"
            )
        return (
            f"normalization {name!r} has no form in {self.label} (it implements "
            f"{', '.join(names)}; backend 'blockwise' runs any registered one)"
        )
