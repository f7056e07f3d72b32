"""Run `urpe bench model` and refresh its section of BENCHMARKS.md and benchmarks/model.json.

python benchmarks/bench_model.py            # the full run, idle and with a busy core (minutes)
python benchmarks/bench_model.py --quick    # a smoke run at tiny sizes (its numbers mean nothing)
python benchmarks/bench_model.py --help     # groups, conditions, repeats
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from urpe.bench import model

ROOT = Path(__file__).resolve().parent.parent

if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        prog="bench_model.py", formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    model.add_arguments(parser)
    parser.set_defaults(json=ROOT / "benchmarks" / "model.json", markdown=ROOT / "BENCHMARKS.md")
    sys.exit(model.run(parser.parse_args()))
