"""Training quality: Decoupled DiLoCo vs synchronous DiLoCo vs data-parallel, at equal tokens.

The same command as ``ddiloco bench quality`` (``ddiloco.bench.quality``); see docs/quality.md.

    python benchmarks/quality.py [--quick] [--out DIR | --publish] [--models dense,moe,vision] [--jobs N] [--only ROWS]
"""

from __future__ import annotations

import typer

from ddiloco.bench.command import quality_command

if __name__ == "__main__":
    typer.run(quality_command)
