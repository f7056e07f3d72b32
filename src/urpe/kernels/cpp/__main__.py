"""`python -m urpe.kernels.cpp`: build the C++ kernel now (what `make setup` runs)."""

import sys

from .build import main

sys.exit(main())
