"""Run `urpe bench attention` and refresh BENCHMARKS.md and benchmarks/memory.png.

python benchmarks/bench_attention.py            # the full default run (several minutes)
python benchmarks/bench_attention.py --help     # sizes, dtypes, rows, repeats
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from urpe.bench import attention

ROOT = Path(__file__).resolve().parent.parent

if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        prog="bench_attention.py", formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    attention.add_arguments(parser)
    parser.set_defaults(
        json=ROOT / "benchmarks" / "attention.json",
        markdown=ROOT / "BENCHMARKS.md",
        plot=ROOT / "benchmarks" / "memory.png",
    )
    sys.exit(attention.run(parser.parse_args()))
