"""Where a row spends its time: self CPU time per operator (torch.profiler)."""

from __future__ import annotations

import torch

from .clocks import Call
from .inputs import make_inputs
from .rows import rows_for


def profile_row(name: str, shape: dict, length: int, top: int = 12, calls: int = 3) -> list[dict]:
    """The `top` operators of row `name`'s float32 forward+backward at `length` by self CPU
    time, per call (averaged over `calls` after a warm-up), with their share of the total."""
    from torch.profiler import ProfilerActivity, profile

    inputs = make_inputs(shape["batch"], shape["heads"], length, shape["head_dim"], torch.float32)
    call = Call(rows_for("cpu")[name].build(inputs, False), "fwdbwd", inputs)
    call()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            call()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    return [
        dict(
            op=e.key,
            ms_per_call=e.self_cpu_time_total / 1e3 / calls,
            share=e.self_cpu_time_total / total,
            count=e.count // calls,
        )
        for e in events[:top]
    ]
