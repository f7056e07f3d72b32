"""Compile the Triton kernels for real GPUs (sm_80, sm_90) ahead of time, without one, and
report registers, spills and shared memory per configuration (harness/compile_matrix.py).

python benchmarks/compile_kernels.py --quick         # a representative subset (minutes)
python benchmarks/compile_kernels.py --jobs 8        # the whole matrix
python benchmarks/compile_kernels.py --help
"""

from __future__ import annotations

import sys

from harness import compile_matrix, scripts

if __name__ == "__main__":
    parser = scripts.parser("compile_kernels.py", __doc__.splitlines()[0])
    compile_matrix.add_arguments(parser)
    sys.exit(scripts.main(parser, compile_matrix.run))
