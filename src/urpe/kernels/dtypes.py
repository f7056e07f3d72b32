"""Which dtypes the kernels take and what they compute in, defined once for every backend."""

from __future__ import annotations

import torch

# Half precision is stored as given but computed (logits, normaliser, accumulator) in float32:
# the paper's code also runs the softmax there.
HALF = (torch.float16, torch.bfloat16)
FLOATING = (*HALF, torch.float32, torch.float64)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a kernel computes in for inputs of `dtype` (float32 for half precision)."""
    return torch.float32 if dtype in HALF else dtype
