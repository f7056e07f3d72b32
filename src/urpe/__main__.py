"""`python -m urpe ...`: the same as the `urpe` command."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
