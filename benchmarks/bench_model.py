"""Refresh the model section of BENCHMARKS.md and benchmarks/model.json: what URPE costs inside
a model (harness/model.py).

python benchmarks/bench_model.py            # `make bench-model`: idle and one core busy
python benchmarks/bench_model.py --quick --compile-backend eager   # every group at tiny sizes
python benchmarks/bench_model.py --groups calls decoder --conditions idle   # a few groups
python benchmarks/bench_model.py --help     # groups, conditions, repeats
"""

from __future__ import annotations

import sys
from pathlib import Path

from harness import model, scripts

ROOT = Path(__file__).resolve().parent.parent

if __name__ == "__main__":
    parser = scripts.parser("bench_model.py", __doc__.splitlines()[0])
    model.add_arguments(parser)
    parser.set_defaults(json=ROOT / "benchmarks" / "model.json", markdown=ROOT / "BENCHMARKS.md")
    sys.exit(scripts.main(parser, model.run))
