"""Peak memory of one CPU call, each in a fresh subprocess.

Peak memory is the growth of the resident set: the peak resident set during the call (reset
just before it) minus the resident set just before it (Linux /proc). It counts every
allocation, torch's or not. `python -m urpe.bench.memory SPEC` is the subprocess side.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from .clocks import Call
from .inputs import make_inputs
from .rows import rows_for, skip_reason

MEMORY_ROWS = ("reference_urpe", "blockwise_urpe", "blockwise_rpe", "cpp_urpe", "sdpa")


def _status_bytes(field: str) -> int:
    """A field of /proc/self/status (VmRSS: resident now, VmHWM: peak resident), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"{field} not in /proc/self/status")


def _reset_peak_rss() -> None:
    """Set the peak resident set (VmHWM) back to the current size (Linux >= 4.0), so the peak
    read after the call is the call's, not import time's."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def probe(spec: str) -> float:
    """Subprocess side: run one call described by `spec` (name,length,dtype,mode,batch,heads,
    head_dim) and return its peak MB above the resident set before it."""
    import torch

    name, length, dtype, mode, batch, heads, head_dim = spec.split(",")
    inputs = make_inputs(int(batch), int(heads), int(length), int(head_dim), getattr(torch, dtype))
    call = Call(rows_for("cpu")[name].build(inputs, False), mode, inputs)
    before = _status_bytes("VmRSS")
    _reset_peak_rss()
    call()
    return (_status_bytes("VmHWM") - before) / 2**20


def measure_memory(
    name: str, length: int, dtype: str, mode: str, shape: dict, threads: int = 0
) -> dict:
    """One point, measured in a fresh interpreter; a failed subprocess (out of memory, say) is
    recorded with its exit code and last line."""
    spec = ",".join(
        map(str, (name, length, dtype, mode, shape["batch"], shape["heads"], shape["head_dim"]))
    )
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {}))
    command = [sys.executable, "-m", "urpe.bench.memory", spec]
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    record = dict(name=name, length=length, dtype=dtype, mode=mode)
    if done.returncode != 0:
        last = done.stderr.strip().splitlines()[-1:] or ["no message (killed: out of memory?)"]
        record["skipped"] = f"probe failed with exit code {done.returncode}: {last[0][:160]}"
        return record
    record["peak_mb"] = json.loads(done.stdout.strip().splitlines()[-1])["peak_mb"]
    return record


def memory_curves(args, progress) -> list[dict]:
    """float32 forward+backward peak memory of the memory rows among --rows, per length."""
    rows = rows_for("cpu")
    names = [name for name in MEMORY_ROWS if name in args.rows and name in rows]
    shape = dict(batch=args.batch, heads=args.heads, head_dim=args.head_dim)
    records = []
    for length in args.memory_lengths:
        for name in names:
            reason = skip_reason(rows[name], length, args)
            limit = args.reference_memory_max_length
            if name == "reference_urpe":  # a subprocess may try longer than the timing does
                reason = f"reference skipped above L={limit}" if length > limit else None
            if reason is not None:
                records.append(
                    dict(name=name, length=length, dtype="float32", mode="fwdbwd", skipped=reason)
                )
                continue
            record = measure_memory(name, length, "float32", "fwdbwd", shape, args.threads)
            records.append(record)
            progress(f"  memory {name} L={length}: {record.get('peak_mb', 0):.0f} MB")
    return records


if __name__ == "__main__":
    print(json.dumps(dict(peak_mb=probe(sys.argv[1]))))
