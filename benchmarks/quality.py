"""Training quality: Decoupled DiLoCo vs synchronous DiLoCo vs data-parallel, at equal tokens.

A thin wrapper over ``ddiloco.bench.quality`` (also ``ddiloco bench quality``); see docs/quality.md.

    python benchmarks/quality.py [--quick] [--json PATH] [--models dense,moe,vision] [--docs] [--jobs N]
"""

from __future__ import annotations

import sys

from ddiloco.bench.quality import main

if __name__ == "__main__":
    sys.exit(main())
