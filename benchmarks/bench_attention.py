"""Refresh BENCHMARKS.md's attention report, benchmarks/attention.json and memory.png: a run of
`urpe bench attention` plus contention, end-to-end steps, targets and the report
(harness/attention_report.py).

python benchmarks/bench_attention.py --contention   # `make bench` (about 12 minutes on 2 cores)
python benchmarks/bench_attention.py --help         # sizes, dtypes, rows, repeats
python benchmarks/bench_attention.py --gpu-report gpu_d64.json gpu_d128.json   # the GPU section
"""

from __future__ import annotations

import sys
from pathlib import Path

from harness import attention_report, scripts

ROOT = Path(__file__).resolve().parent.parent

if __name__ == "__main__":
    parser = scripts.parser("bench_attention.py", __doc__.splitlines()[0])
    attention_report.add_arguments(parser)
    parser.set_defaults(
        json=ROOT / "benchmarks" / "attention.json",
        markdown=ROOT / "BENCHMARKS.md",
        plot=ROOT / "benchmarks" / "memory.png",
    )
    sys.exit(scripts.main(parser, attention_report.run))
