"""The backends (kernels) `urpe.attention` dispatches to, and how "auto" chooses one.

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

A backend that can work out once per kind of call what the kind fixes (op arguments, tile
sizes) also gives `prepare=`: spec -> the run for every call of that spec's kind (`Backend`;
the C++ kernel's `CppRun`). A prepared call then keeps that run.

A compiled kernel reaches its code through torch's dispatcher (custom ops: what torch.compile,
torch.func, modes and tensor subclasses see). Where the dispatcher would do nothing but call the
kernel's function (no gradient, plain tensors, no mode, no transform, no profiler, not tracing:
`host.dispatcher_free`), it may call the function itself: the C++ kernel's no-gradient forward
calls its library's Python entry there (`cpp.ops.NoGradForward`), which saves a decoding step
the dispatcher's work on 17 arguments. Each mode still has one route.

`run` receives one `AttentionSpec` (see `spec.py`): q (B, H, Lq, D), k, v (B, Hkv, Lk, *) with
Hkv dividing H (grouped queries), bias and gate (None or a `Term`: `Dense`, `Toeplitz`,
`Relation` with a range-checked (B|1, Lq, Lk) int64 index, a `Decay` bias, or a kind registered
later; see `terms.py`), attn_mask (4-D, bool = hides, float = added to the logits),
key_padding_mask (B|1, Lk), document_ids (B|1, Lk), is_causal (the last query meets the last
key), normalization (a name in `NORMALIZATIONS`; `spec.norm` is its entry), scale, dropout_p and
dropout_seed (None: draw one if you need one). What a backend must do: hidden pairs get weight
exactly 0; a row with no visible key returns 0 (no NaN) with zero gradients; a row of -inf logits
likewise returns 0. What it need not do, because `execute` does it around every backend: empty
calls, non-finite q/k/v (they arrive finite), overflow checks for `exp`, and leading batch dims.

What a backend can run is declared once in its `Capabilities` table (`capabilities.py`:
normalisations, term kinds, dtypes, devices, gradients, dropout, head dims); `unsupported(spec)`
adds what a table cannot say. Where either refuses a call, "auto" skips it and naming the
backend raises that reason (`Backend.refusal`); `defers(spec)` says why "auto" should leave a
call it could run to a later backend. "auto" tries backends by descending `priority` (None: only
by name). None of these may depend on the keys' length Lk alone (a prepared call serves a
growing KV cache with the backend chosen once; see `prepared`), nor on tensor values.

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

from torch import Tensor

from .blockwise import BLOCKWISE_CAPABILITIES, blockwise_defers, blockwise_run
from .capabilities import Capabilities
from .reference import REFERENCE_CAPABILITIES, reference_run
from .sdpa import SDPA_CAPABILITIES, sdpa_run, sdpa_unsupported
from .spec import AttentionSpec, resolve
from .watched import WatchedDict, WatchedList


def _always(spec: AttentionSpec) -> str | None:
    return None


class BackendFailure(RuntimeError):
    """A backend could not run a call it accepts, on this machine (see the module docstring)."""


# (backend name, device type) -> why it failed there: "auto" skips it from then on (watched:
# prepared calls choose again)
BROKEN: dict[tuple[str, str], str] = WatchedDict()
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
    the benchmark rows that sweep them) and its `unsupported` gives the same reason.
    `prepare`: optional, spec -> a run function for every call of that spec's kind (shapes but
    Lk, dtypes, devices, term kinds, scalar arguments: `prepared.call_kind`), so that a prepared
    call does once what the kind fixes (the C++ kernel's op arguments: `cpp.CppRun`); it must
    give what `run` gives on every such call."""

    name: str
    run: Callable[[AttentionSpec], Tensor]
    unsupported: Callable[[AttentionSpec], str | None] = _always
    priority: float | None = None
    defers: Callable[[AttentionSpec], str | None] | None = None
    capabilities: Capabilities = Capabilities("the backend")
    available: Callable[[], str | None] | None = None
    prepare: Callable[[AttentionSpec], Callable[[AttentionSpec], Tensor | None]] | None = None

    def runner(self, spec: AttentionSpec) -> Callable[[AttentionSpec], Tensor | None]:
        """The run function for every call of this spec's kind (`prepared`): `prepare(spec)`,
        which works out once what the kind fixes for the kernel, else `run` itself."""
        return self.run if self.prepare is None else self.prepare(spec)

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


# Watched: any change, registered or by hand, makes prepared calls choose again (`prepared`).
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
        capabilities=REFERENCE_CAPABILITIES,
    )
)
register_backend(
    Backend(
        "sdpa",
        sdpa_run,
        sdpa_unsupported,
        priority=20,
        capabilities=SDPA_CAPABILITIES,
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


def mark_broken(backend: Backend, spec: AttentionSpec, failure: BackendFailure) -> None:
    """ "auto" skips this backend on this device type from now on (and says so once)."""
    BROKEN[(backend.name, spec.q.device.type)] = str(failure)
    _warn_once(
        f"urpe.attention: backend {backend.name!r} cannot run on this "
        f"{spec.q.device.type} device ({failure}); using the next backend instead"
    )
