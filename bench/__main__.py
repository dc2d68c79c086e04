from __future__ import annotations

import sys

from bench.run import main

# Guarded: multiprocessing's spawn imports this module in its children.
if __name__ == "__main__":
    sys.exit(main())
