"""When the attention path may read a tensor's value on the host, and when it must not.

Reading a value (`bool(t)`, `int(t)`, `.item()`, `.tolist()`) makes the host wait for the device
that holds the tensor. On the CPU that costs nothing (the value is already there), so the CPU
paths use it for shortcuts: skip the non-finite rule's copies when everything is finite, skip key
blocks that padding hides, check a relation index's range with one exact error. On an
accelerator each read is a host-device synchronisation: it stalls the stream, and a CUDA graph
cannot capture it. There the same work is done by tensor ops that never read a value, and
checks run on the device (issue 28). Under torch.compile and torch.func no value can be read.

One read is left on an accelerator: `normalization="exp"` raises ValueError when its result
overflows, which needs the result on the host (every other normalisation is bounded).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd import forward_ad

# Device types whose values the hot path may read. Tests empty it to run the accelerators'
# read-free code on the CPU (tests/test_host_reads.py).
READABLE = {"cpu"}


def may_read(*tensors: Tensor) -> bool:
    """Whether values of these tensors may be read on the host here and now."""
    for t in tensors:
        if t.device.type not in READABLE:
            return False
    return not (torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active())


# ---------------------------------------------------------------------------------------------
# The mode a call runs in, answered once here for the whole call path

PLAIN = (Tensor, torch.nn.Parameter)  # plain tensors' types (no subclass)


def plain_tensors(*tensors: Tensor | None) -> bool:
    """Whether each tensor (None: absent) is a plain `Tensor` or `Parameter`, no subclass (a
    subclass may redefine what an op does, so it takes the path that asks nothing of it)."""
    for t in tensors:
        if t is not None and type(t) not in PLAIN:
            return False
    return True


# The two questions as the functions themselves, read once (torch.compile recognises them by
# identity when it traces a call; a lookup through torch.compiler costs on every call)
compiling = torch.compiler.is_compiling
transforms_active = torch._C._are_functorch_transforms_active


def tracing() -> bool:
    """Whether torch.compile is tracing or a torch.func transform (vmap, grad, jvp) is active:
    then the custom ops' registration (fakes, vmap rules) is what must run, values cannot be
    read, and nothing may be remembered across calls."""
    return compiling() or transforms_active()


def plain_eager(*tensors: Tensor | None) -> bool:
    """Whether a call runs in plain eager mode: not `tracing()`, no dispatch or function mode,
    plain tensors. Then a kernel's own functions may be called directly instead of through its
    custom ops (the same results, without about 150 us of the ops' machinery per call)."""
    return not (
        tracing()
        or torch._C._len_torch_dispatch_stack()
        or torch._C._is_torch_function_mode_enabled()
    ) and plain_tensors(*tensors)


# What torch's dispatcher looks at before it calls an op's kernel, as the functions themselves
_dispatch_modes = torch._C._len_torch_dispatch_stack
_function_modes = torch._C._is_torch_function_mode_enabled
_profiling = torch._C._autograd._profiler_enabled


def dispatcher_free(tensors: tuple) -> bool:
    """Whether torch's dispatcher would do nothing but call an op's CPU function on these
    tensors (None: absent), in a call that records no gradient outside torch.compile's tracing
    (the caller knows both): plain tensors, no dispatch or function mode, no torch.func
    transform, no profiler recording ops. Then the function may be called directly (a kernel's
    Python entry), without the dispatcher's handling of every argument."""
    if _dispatch_modes() or _function_modes() or transforms_active() or _profiling():
        return False
    for t in tensors:
        if t is not None and type(t) not in PLAIN:
            return False
    return True


def records_grad(*tensors: Tensor | None) -> bool:
    """Whether autograd records a call on these tensors: grad mode on and one requires grad."""
    if not torch.is_grad_enabled():
        return False
    for t in tensors:
        if t is not None and t.requires_grad:
            return True
    return False


def forward_ad_active() -> bool:
    """Whether tensors may carry forward-mode AD tangents here (inside a `dual_level`, which
    `torch.func.jvp` enters too)."""
    return forward_ad._current_level >= 0


def dual_tensors(*tensors: Tensor | None) -> bool:
    """Whether any of these tensors carries a forward-mode AD tangent."""
    if not forward_ad_active():
        return False
    for t in tensors:
        if t is not None and forward_ad.unpack_dual(t).tangent is not None:
            return True
    return False
