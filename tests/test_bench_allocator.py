"""The benchmarks' allocator setting: freed memory is kept for the next call, and said."""

import platform
import subprocess
import sys

import pytest

glibc = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only"
)

# page faults while three 8 MiB tensors (a backward's dq, dk, dv) are made and freed 20 times,
# after two untimed rounds
_FAULTS = """
import resource, sys, torch
from urpe.bench.machine import keep_freed_memory, cpu_info
if sys.argv[1] == "kept":
    print(keep_freed_memory(), file=sys.stderr)
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def step():
    grads = [torch.empty(2 * 2**20).fill_(1.0) for _ in range(3)]
    del grads
for _ in range(2):
    step()
before = faults()
for _ in range(20):
    step()
print(faults() - before)
print(cpu_info()["allocator"])
"""


def _run(mode: str) -> tuple[int, str]:
    done = subprocess.run(
        [sys.executable, "-c", _FAULTS, mode], capture_output=True, text=True, check=True
    )
    faults, allocator = done.stdout.split("\n")[:2]
    return int(faults), allocator


@glibc
def test_kept_memory_is_reused_without_page_faults():
    faults, allocator = _run("kept")
    # Not a step's 24 MiB of faults (6,144) in every one of the 20 steps (122,880), as glibc's
    # own thresholds give in most processes: about the heap's first growth, 6,144-12,288 on a
    # quiet machine. One CI run under load counted 14,336 (the kernel also faults pages for its
    # own reasons), so the bound is a quarter of the steps' faults.
    assert faults <= 20 * 6144 // 4, faults
    assert allocator.startswith("glibc, freed memory kept (mmap threshold ")


@glibc
def test_left_alone_unless_asked():
    # (glibc's own thresholds hand the freed 24 MiB back in most steps of most processes, but
    # not all: the reason for the setting, and why it is not asserted here)
    _, allocator = _run("default")
    assert allocator == "as the process found it"
