"""What a benchmark ran on, recorded beside its numbers."""

from __future__ import annotations

import ctypes
import os
import platform

import torch

# mallopt's parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_allocator = "as the process found it"


def keep_freed_memory(trim: int = 2**30, mmap: int = 2**28) -> str:
    """Have glibc's malloc keep freed blocks for reuse rather than hand them back to the kernel
    between timed calls; returns what was set (also in `cpu_info`).

    By default glibc raises its mmap threshold to the size of each large block freed, and trims
    the heap's free top beyond twice that. Whether a call's 8 MB tensors (a 4,096-row output,
    its gradients) then come back from the heap or as fresh, zero-filled pages (one fault per
    4 KiB: ~7,000 faults, several ms, per padded fwd+bwd call) depends on the heap's layout, so
    it differs between two runs of one script: the same call measured 11 ms in one process and
    29 ms in the next. Fixed thresholds make every call reuse the memory, as the allocators
    users often put under PyTorch (jemalloc, tcmalloc) do. Elsewhere (not glibc): nothing."""
    global _allocator
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return _allocator
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return _allocator
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    # (where glibc refuses a threshold over 32 MiB, its older limit: that one)
    mapped = next((size for size in (mmap, 2**25) if mallopt(_M_MMAP_THRESHOLD, size)), None)
    trimmed = bool(mallopt(_M_TRIM_THRESHOLD, trim))
    if mapped is not None and trimmed:
        _allocator = (
            f"glibc, freed memory kept (mmap threshold {mapped >> 20} MiB, trim {trim >> 20} MiB)"
        )
    return _allocator


class StolenTime:
    """The share of CPU time the hypervisor gave to other guests while a block ran (Linux's
    "steal" ticks in /proc/stat, over all CPUs): a virtual machine's timings move with it,
    and a run whose ratios flip between two runs of the same code can show why. None where
    the system counts no such time (not Linux, or a kernel without the field).

        with StolenTime() as stolen:
            ...                      # the timed block
        stolen.fraction              # 0.0 .. 1.0, or None

    or `start()` ... `stop()` (which returns the fraction) where a block has no one scope.
    """

    def __init__(self) -> None:
        self.fraction: float | None = None
        self._start: tuple[int, int] | None = None

    def start(self) -> StolenTime:
        self.fraction, self._start = None, _cpu_ticks()
        return self

    def stop(self) -> float | None:
        end = _cpu_ticks()
        if self._start is not None and end is not None and end[0] > self._start[0]:
            self.fraction = (end[1] - self._start[1]) / (end[0] - self._start[0])
        return self.fraction

    def __enter__(self) -> StolenTime:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _cpu_ticks() -> tuple[int, int] | None:
    """(all, stolen) ticks of every CPU since boot, from /proc/stat's first line: user, nice,
    system, idle, iowait, irq, softirq, steal (guest time is counted in user already)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if len(fields) < 9 or fields[0] != "cpu" or not all(x.isdigit() for x in fields[1:9]):
        return None
    ticks = [int(x) for x in fields[1:9]]
    return sum(ticks), ticks[7]


def cpu_info() -> dict:
    """CPU model, cores, torch threads and SIMD level, versions, load average now."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    return dict(
        cpu=cpu,
        cores=os.cpu_count(),
        threads=torch.get_num_threads(),
        capability=torch.backends.cpu.get_cpu_capability(),
        torch=torch.__version__,
        python=platform.python_version(),
        load_average=os.getloadavg(),
        allocator=_allocator,
    )


def gpu_info() -> dict:
    """The first CUDA device and the versions of torch, Triton and CUDA."""
    import triton

    props = torch.cuda.get_device_properties(0)
    return dict(
        gpu=props.name,
        multiprocessors=props.multi_processor_count,
        memory_gb=round(props.total_memory / 2**30, 1),
        torch=torch.__version__,
        triton=triton.__version__,
        cuda=torch.version.cuda,
        python=platform.python_version(),
    )
