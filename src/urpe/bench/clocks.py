"""How a call is run once and how its time is taken, per device.

CPU: wall time (`time.perf_counter`), calls interleaved within each repeat, medians, so that load
from other processes hits every call alike. CUDA: kernels by `triton.testing.do_bench` (CUDA
events, L2 flushed between repeats, median) with the peak of `torch.cuda.max_memory_allocated`
above what was allocated before the call; longer steps (a training step) by CUDA events,
interleaved like the CPU's.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Hashable

import torch

MODES = ("fwd", "fwdbwd")


class Call:
    """One row in one mode as a no-argument callable: the forward under `no_grad`, or forward
    and backward (a gradient of ones) with the leaves' gradients reset first."""

    def __init__(self, fn: Callable[[], torch.Tensor], mode: str, inputs: dict[str, torch.Tensor]):
        self.fn, self.mode, self.inputs = fn, mode, inputs
        self._grad: torch.Tensor | None = None

    def reset_grads(self) -> None:
        for t in self.inputs.values():  # read at call time: a row may add an input (dense bias)
            t.grad = None

    def __call__(self) -> None:
        if self.mode == "fwd":
            with torch.no_grad():
                self.fn()
            return
        self.reset_grads()
        out = self.fn()
        if self._grad is None:
            self._grad = torch.ones_like(out)
        out.backward(self._grad)


def _perf_counter_ms(call: Callable[[], None]) -> float:
    start = time.perf_counter()
    call()
    return 1e3 * (time.perf_counter() - start)


def _cuda_event_ms(call: Callable[[], None]) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    call()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def interleaved_medians(
    calls: dict[Hashable, Callable[[], None]], repeats: int, device: str = "cpu", progress=None
) -> dict[Hashable, float]:
    """Median ms of every call over `repeats` rounds; each round runs every call once, starting
    one further along the list each time, so no call always follows the same one."""
    timer = _cuda_event_ms if device == "cuda" else _perf_counter_ms
    keys = list(calls)
    samples: dict[Hashable, list[float]] = {key: [] for key in keys}
    for repeat in range(repeats):
        shift = repeat % len(keys) if keys else 0
        for key in keys[shift:] + keys[:shift]:
            samples[key].append(timer(calls[key]))
        if progress is not None:
            progress(f"repeat {repeat + 1}/{repeats}")
    return {key: statistics.median(values) for key, values in samples.items()}


def cuda_measure(call: Call) -> dict[str, float]:
    """One call on CUDA: median ms (`do_bench`) and peak MB above the inputs (their gradients
    count as the call's)."""
    import triton.testing

    call.reset_grads()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    call()
    torch.cuda.synchronize()
    peak_mb = (torch.cuda.max_memory_allocated() - before) / 2**20
    ms = triton.testing.do_bench(call, warmup=25, rep=100, return_mode="median")
    return dict(time_ms=float(ms), peak_mb=float(peak_mb))
