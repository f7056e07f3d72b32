"""`urpe.attention`: one functional entry point, several interchangeable kernels (backends).

Adding a backend
----------------
A backend is registered once and is then used by `backend="auto"`, selectable by name, run
by the tests that enumerate `BACKENDS` (tests/test_backend_conformance.py, which asks for a
runner, tests/test_properties.py, tests/test_transforms.py, ...) against the reference, and timed
by `urpe bench attention` (row `<name>_urpe`):

    from urpe.kernels import AttentionSpec, Backend, Capabilities, register_backend
    from urpe.kernels.capabilities import built_in

    def my_unsupported(spec: AttentionSpec) -> str | None:
        return None if my_kernel_loads() else "no build"  # a reason, or None when it can run

    def my_run(spec: AttentionSpec) -> Tensor:            # (B, H, Lq, Dv) in spec.q.dtype
        ...

    # what a table can state (normalisations, term kinds, dtypes, devices, ...) goes in it
    table = Capabilities("my kernel", normalizations=built_in("softmax"), devices=("cuda",))
    register_backend(Backend("triton", my_run, my_unsupported, priority=40,
                             capabilities=table))

`run` receives one `AttentionSpec` (see `spec.py`): q (B, H, Lq, D), k, v (B, Hkv, Lk, *) with
Hkv dividing H (grouped queries), bias and gate (None, a dense 4-D tensor, `Toeplitz` or
`Relation` with a range-checked (B|1, Lq, Lk) int64 index), attn_mask (4-D, bool = hides, float =
added to the logits), key_padding_mask (B|1, Lk), is_causal (the last query meets the last key),
normalization (a name in `NORMALIZATIONS`; `spec.norm` is its entry), scale, dropout_p and
dropout_seed (None: draw one if you need one). What a backend must do: hidden pairs get weight
exactly 0; a row with no visible key returns 0 (no NaN) with zero gradients; a row of -inf logits
likewise returns 0. What it need not do, because `execute` does it around every backend: empty
calls, non-finite q/k/v (they arrive finite), overflow checks for `exp`, and leading batch dims.
What a backend can run is declared once in its `Capabilities` table (`capabilities.py`:
normalisations, term kinds, dtypes, devices, gradients, dropout, head dims); `unsupported(spec)`
adds what a table cannot say. Where either refuses a call, "auto" skips it and naming the
backend raises that reason (`Backend.refusal`); `defers(spec)` says why "auto" should leave a
call it could run to a later backend. "auto" tries backends by descending `priority` (None: only
by name).

A backend that accepts a call but cannot run on this machine (a GPU kernel that does not compile
or launch on this GPU, a broken install) raises `BackendFailure` from `run`. "auto" then warns
once, naming the reason, skips that backend on that device type for the rest of the process,
and runs the call on the next backend; a backend asked for by name raises the failure. (A
failure in the backward pass, after a forward pass that ran, cannot change backend: it raises.)
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from . import plans
from .blockwise import BLOCKWISE_CAPABILITIES, blockwise_defers, blockwise_run
from .capabilities import Capabilities
from .execute import execute
from .reference import reference_run
from .sdpa import SDPA_CAPABILITIES, sdpa_run, sdpa_unsupported
from .spec import AttentionSpec, resolve
from .tables import PositionTerm, Toeplitz
from .watched import WatchedDict, WatchedList


def _always(spec: AttentionSpec) -> str | None:
    return None


class BackendFailure(RuntimeError):
    """A backend could not run a call it accepts, on this machine (see the module docstring)."""


# (backend name, device type) -> why it failed there: "auto" skips it from then on
BROKEN: dict[tuple[str, str], str] = {}
_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=4)


@dataclass(frozen=True)
class Backend:
    """A kernel: name, run(spec) -> output, why it cannot run a call beyond what its
    `capabilities` table says (None: it can), its place in "auto" (higher priority first; None:
    never chosen by "auto") and why "auto" should pass a call it could run on to a later
    backend. `available`: why it cannot run on this machine at all (a kernel that failed to
    build), or None; such a backend is left out of `native_backends` (and so of the tests and
    the benchmark rows that sweep them) and its `unsupported` gives the same reason."""

    name: str
    run: Callable[[AttentionSpec], Tensor]
    unsupported: Callable[[AttentionSpec], str | None] = _always
    priority: float | None = None
    defers: Callable[[AttentionSpec], str | None] | None = None
    capabilities: Capabilities = Capabilities("the backend")
    available: Callable[[], str | None] | None = None
    # spec -> a one-call forward for remembered calls of its signature that need no gradient
    # (decoding), or None; see `urpe.kernels.cpp.direct`
    direct: Callable[[AttentionSpec], Callable[[AttentionSpec], Tensor | None] | None] | None = None
    # True: for calls without dropout and with more keys than queries, its `unsupported`,
    # `defers` and `direct` decide nothing from the keys' length Lk, so a plan made at one Lk
    # serves a growing KV cache (`plans.kin`). False (the default): it may, so its plans are
    # remembered for their exact signature only
    keys_length_free: bool = False

    @property
    def devices(self) -> tuple[str, ...] | None:
        """The device types it is built for (None: any); see `Capabilities`."""
        return self.capabilities.devices

    def refusal(self, spec: AttentionSpec) -> str | None:
        """Why it cannot run this call: its table's reason, else its own `unsupported`'s."""
        return self.capabilities.refuses(spec) or self.unsupported(spec)


# Old backend names -> today's. An old name keeps working (configs, command lines, checkpoints
# and run records that hold it) with one DeprecationWarning per process.
RENAMED_BACKENDS = {"fused": "blockwise"}


def current_backend_name(name: str) -> str:
    """`name`, or today's name for a renamed backend (warning once that the old one is
    deprecated)."""
    new = RENAMED_BACKENDS.get(name) if type(name) is str else None
    if new is None:
        return name
    message = f"backend {name!r} is deprecated: it is called {new!r} now"
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, DeprecationWarning, stacklevel=3)
    return new


# Watched: any change, registered or by hand, voids the remembered calls (see `plans`).
BACKENDS: dict[str, Backend] = WatchedDict()
# Tried in this order by backend="auto"; the reference always applies, so it comes last.
AUTO_ORDER: list[str] = WatchedList()


def register_backend(backend: Backend) -> Backend:
    """Add (or replace) a backend; it is then available by name and, with a priority, to auto."""
    BACKENDS[backend.name] = backend
    ranked = [b for b in BACKENDS.values() if b.priority is not None]
    AUTO_ORDER[:] = [b.name for b in sorted(ranked, key=lambda b: -b.priority)]
    return backend


register_backend.registries = (BACKENDS, AUTO_ORDER)  # for `registered`


register_backend(
    Backend(
        "reference",
        reference_run,
        priority=0,
        capabilities=Capabilities("the reference"),
        keys_length_free=True,
    )
)
register_backend(
    Backend(
        "sdpa",
        sdpa_run,
        sdpa_unsupported,
        priority=20,
        capabilities=SDPA_CAPABILITIES,
        keys_length_free=True,
    )
)
# Blockwise goes before SDPA: it takes gates, structured biases and every normalisation, and leaves
# plain softmax to SDPA (see `blockwise_defers` for the measured rule). On the CPU the compiled
# C++ kernel ("cpp", registered in `urpe.kernels`) goes before blockwise, its fallback.
register_backend(
    Backend(
        "blockwise",
        blockwise_run,
        priority=30,
        defers=blockwise_defers,
        capabilities=BLOCKWISE_CAPABILITIES,
        keys_length_free=True,
    )
)


def native_backends(device_type: str) -> list[str]:
    """Names of the registered backends built for this device type ("cpu", "cuda", ...) that
    can run on this machine."""
    return [
        n
        for n, b in BACKENDS.items()
        if (b.devices is None or device_type in b.devices)
        and (b.available is None or b.available() is None)
    ]


def auto_candidates(spec: AttentionSpec) -> list[Backend]:
    """The backends "auto" would try for this call, in order (one that failed on this device
    type earlier in the process is left out)."""
    return list(_auto_iter(spec))


def _auto_iter(spec: AttentionSpec) -> Iterator[Backend]:
    """`auto_candidates`, lazily: a call asks only as many backends as it tries (and asks
    `defers`, usually the cheaper question, before `unsupported`)."""
    device = spec.q.device.type
    for name in AUTO_ORDER:
        backend = BACKENDS[name]
        if (
            (name, device) not in BROKEN
            and (backend.defers is None or backend.defers(spec) is None)
            and backend.refusal(spec) is None
        ):
            yield backend


def choose_backend(backend: str, spec: AttentionSpec) -> Backend:
    """The kernel `attention` would use for this resolved call."""
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a string, got {type(backend).__name__}")
    backend = current_backend_name(backend)
    if backend == "auto":
        for candidate in _auto_iter(spec):
            return candidate
        raise RuntimeError(f"no registered backend accepts this call (auto order {AUTO_ORDER})")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be 'auto' or one of {sorted(BACKENDS)}, got {backend!r}")
    reason = BACKENDS[backend].refusal(spec)
    if reason is not None:
        raise ValueError(f"backend {backend!r} cannot run this call: {reason}")
    return BACKENDS[backend]


def select_backend(backend: str, q: Tensor, k: Tensor, v: Tensor, **kwargs) -> Backend:
    """The kernel `attention(q, k, v, **kwargs, backend=backend)` would use."""
    return choose_backend(backend, resolve(q, k, v, **kwargs))


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    bias: PositionTerm | None = None,
    gate: PositionTerm | None = None,
    key_padding_mask: Tensor | None = None,
    normalization: str = "softmax",
    dropout_seed: int | Tensor | None = None,
    document_ids: Tensor | None = None,
    backend: str = "auto",
) -> Tensor:
    """URPE attention: out = dropout(normalize(scale * q k^T + B + M) * C) @ v.

    The first eight arguments are `F.scaled_dot_product_attention`'s, with its meaning (except
    the causal alignment when Lq != Lk, below); the rest are urpe's.

    Args:
        q: (..., H, Lq, D) queries. k: (..., Hkv, Lk, D) keys. v: (..., Hkv, Lk, Dv) values. Any
            number of leading (batch) dims, the same for q, k and v.
        attn_mask: broadcastable to (..., H, Lq, Lk). Bool: True takes part, False hides the pair.
            Float: added to the logits (M), like a bias (a -inf gives weight 0 but does not hide
            the key's contents; see below).
        dropout_p: dropout on the weights (after the gate). Pass 0 at evaluation.
        is_causal: query i sees keys j <= i + Lk - Lq: the LAST query is aligned with the LAST
            key, as decoding with a KV cache needs. SDPA aligns the first with the first
            (j <= i); the two agree when Lq == Lk. For SDPA's rule with Lq != Lk pass
            attn_mask=torch.ones(Lq, Lk, dtype=torch.bool).tril() instead.
        scale: logit scale, default 1 / sqrt(D).
        enable_gqa: allow k, v with fewer heads than q (grouped-query attention): Hkv must
            divide H and query head h reads key/value head h // (H / Hkv). Bias and gate are per
            query head.
        bias: B, added to the logits before normalisation. A tensor broadcastable to
            (..., H, Lq, Lk), a `Toeplitz` table over offsets j - i, or a `Relation` (a table
            indexed by an integer (..., Lq, Lk) relation; indices out of range raise ValueError).
            Or a `urpe.Decay(log_forget)`: FoX's data-dependent decay -|c_pos(i) - c_j| with
            c = cumsum(log_forget) over the keys, computed from O(L) numbers (bias only).
        gate: C, multiplied into the weights after normalisation (URPE). Same forms as bias
            (but not `Decay`).
        key_padding_mask: bool, broadcastable to (..., Lk); True marks a padded key (as in
            nn.MultiheadAttention: the opposite sense of a bool attn_mask).
        normalization: "softmax", "exp" (no denominator), "l2" (exp / l2 norm of the row),
            "relu2" (relu(s)^2 / n, n the number of keys the query sees), or any name
            registered in `urpe.kernels.NORMALIZATIONS`.
        dropout_seed: int or int64 scalar tensor fixing the dropout masks (reference and blockwise
            backends; SDPA draws its own). Default: drawn from torch's generator.
        document_ids: integer, broadcastable to (..., Lk): packed sequences. Query i belongs
            to the document of key i + Lk - Lq (the `is_causal` alignment, so a KV cache works)
            and sees only keys of its own document; combines with every other argument. The
            same as the dense bool mask ids[pos(i)] == ids[j], without building it on the
            native kernels (which skip tiles where no query and key share a document).
        backend: "auto" (fastest that applies), or a name from `urpe.kernels.BACKENDS`.

    Returns:
        (..., H, Lq, Dv) in q's dtype (half precision is computed in float32).

    Hidden pairs (key_padding_mask, is_causal, document_ids, bool attn_mask) get weight exactly
    0 under every normalisation, and a query with no visible key returns 0 with zero gradients;
    so does a query whose logits are all -inf. A query, key or value row holding NaN/inf is
    treated as zeros and makes exactly the output rows that see it NaN (a non-finite key or
    value that a query cannot see never reaches it); those rows pass no gradient. `exp` raises
    ValueError instead of overflowing. Every backend behaves the same way on all of this.

    Cost around the kernel: a call whose signature (shapes, dtypes, devices, masks' and terms'
    kinds, scalar arguments) was seen before skips the checks and the backend choice (see
    `urpe.kernels.plans`). On a GPU no value is read on the host, forward or backward, so the
    call never waits for the device and a CUDA graph can capture it; the one exception is
    `normalization="exp"`, whose overflow check must read the result (see `urpe.kernels.host`).
    """
    backend = current_backend_name(backend)  # an old name: today's
    key = plans.signature(
        q,
        k,
        v,
        attn_mask,
        dropout_p,
        is_causal,
        scale,
        enable_gqa,
        bias,
        gate,
        key_padding_mask,
        normalization,
        dropout_seed,
        backend,
        BROKEN,
        document_ids,
    )
    plan = None if key is None else plans.find(key) or plans.find_kin(key)
    if plan is not None:
        # seen before: checked, and its backend chosen
        if plan.direct is not None and not _wants_grad(q, k, v, attn_mask, bias, gate):
            if plan.direct_from_arguments is not None:
                out = plan.direct_from_arguments(q, k, v, bias, gate)
            else:
                out = plan.direct(
                    plan.spec(q, k, v, attn_mask, key_padding_mask, bias, gate, document_ids)
                )
            if out is not None:
                return out
        spec = plan.spec(q, k, v, attn_mask, key_padding_mask, bias, gate, document_ids)
        try:
            return execute(plan.backend.run, spec)
        except BackendFailure as failure:
            if backend != "auto":
                raise
            _mark_broken(plan.backend, spec, failure)  # then the full path picks the next one
    spec = resolve(
        q,
        k,
        v,
        attn_mask=attn_mask,
        dropout_p=dropout_p,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=enable_gqa,
        bias=bias,
        gate=gate,
        key_padding_mask=key_padding_mask,
        normalization=normalization,
        dropout_seed=dropout_seed,
        document_ids=document_ids,
    )
    if backend != "auto":
        chosen = choose_backend(backend, spec)
        if key is not None:
            plans.remember(key, plans.Plan.of(chosen, spec), chosen.keys_length_free)
        return execute(chosen.run, spec)
    for candidate in _auto_iter(spec):
        try:
            out = execute(candidate.run, spec)
        except BackendFailure as failure:
            _mark_broken(candidate, spec, failure)
            continue
        if key is not None:
            plans.remember(key, plans.Plan.of(candidate, spec), _decided_without_length(candidate))
        return out
    return execute(choose_backend("auto", spec).run, spec)  # raises: nothing accepts the call


def _decided_without_length(chosen: Backend) -> bool:
    """Whether "auto"'s choice of `chosen` depends on no keys' length: it and every backend
    asked before it say so (`Backend.keys_length_free`)."""
    for name in AUTO_ORDER:
        backend = BACKENDS[name]
        if not backend.keys_length_free:
            return False
        if backend is chosen:
            return True
    return False


def _wants_grad(q, k, v, attn_mask, bias, gate) -> bool:
    """Whether autograd would record this call (the terms as a plan sees them: tensors or
    Toeplitz tables)."""
    if not torch.is_grad_enabled():
        return False
    for t in (q, k, v, attn_mask, bias, gate):
        if t is None:
            continue
        tensor = t.table if type(t) is Toeplitz else getattr(t, "log_forget", t)  # Decay's
        if tensor.requires_grad:
            return True
    return False


def _mark_broken(backend: Backend, spec: AttentionSpec, failure: BackendFailure) -> None:
    """ "auto" skips this backend on this device type from now on (and says so once)."""
    BROKEN[(backend.name, spec.q.device.type)] = str(failure)
    plans.forget()
    _warn_once(
        f"urpe.attention: backend {backend.name!r} cannot run on this "
        f"{spec.q.device.type} device ({failure}); using the next backend instead"
    )


def reference_attention(q: Tensor, k: Tensor, v: Tensor, *args, **kwargs) -> Tensor:
    """`attention(..., backend="reference")`: the plain materialising specification."""
    return attention(q, k, v, *args, **kwargs, backend="reference")
