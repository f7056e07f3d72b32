"""What a benchmark ran on, recorded beside its numbers."""

from __future__ import annotations

import os
import platform

import torch


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
