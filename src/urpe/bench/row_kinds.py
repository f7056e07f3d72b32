"""What a benchmark row is (`Row`), shared by `rows` and `packing_rows`; imports no torch."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

Inputs = dict[str, "torch.Tensor"]
Build = Callable[[Inputs, bool], Callable[[], Any]]  # (inputs, causal) -> call


@dataclass(frozen=True)
class Row:
    """One benchmark row: its name, what it is (help), how to build its call, the devices it
    runs on (None: any), where it has no backward, and the option that caps its length."""

    name: str
    help: str
    build: Build
    devices: tuple[str, ...] | None = None
    forward_only_on: tuple[str, ...] = ()
    length_limit: str | None = None  # an attribute of the parsed arguments

    def has_mode(self, mode: str, device: str) -> bool:
        return mode == "fwd" or device not in self.forward_only_on


# Backends whose rows are too slow or too large past a length: the option that says where.
BACKEND_LENGTH_LIMITS = {"reference": "reference_max_length", "blockwise": "blockwise_max_length"}
