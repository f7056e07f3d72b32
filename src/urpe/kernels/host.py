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

# Device types whose values the hot path may read. Tests empty it to run the accelerators'
# read-free code on the CPU (tests/test_host_reads.py).
READABLE = {"cpu"}


def may_read(*tensors: Tensor) -> bool:
    """Whether values of these tensors may be read on the host here and now."""
    for t in tensors:
        if t.device.type not in READABLE:
            return False
    return not (torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active())
