#!/usr/bin/env bash
# Make .venv and install ddiloco from the lock (constraints.txt): `bash infra/install.sh [EXTRAS]`, e.g. `dev`.
# With uv, which the lock pins and pip fetches in seconds, the whole set installs in about 75 s, most of it compiling bytecode; where uv cannot be
# had, pip installs the same lock (about 2 minutes). uv does not read pip's settings: a machine that keeps its torch
# wheel on disk for pip (PIP_FIND_LINKS) gets the same wheel through UV_FIND_LINKS, not a download of a CUDA build.
# Bytecode is compiled at install, as pip does and uv does not by default: where PYTHONDONTWRITEBYTECODE is set, every
# process would otherwise compile torch from source on import (6.5 s of CPU instead of 2.3 s).
set -euo pipefail
cd "$(dirname "$0")/.."
target=".${1:+[$1]}"
python3 -m venv .venv
if .venv/bin/pip install -q -c constraints.txt uv; then
  UV_FIND_LINKS="${UV_FIND_LINKS:-${PIP_FIND_LINKS:-}}" .venv/bin/uv pip install -q --compile-bytecode --python .venv/bin/python -c constraints.txt -e "$target"
else
  echo "uv could not be installed: installing with pip" >&2
  .venv/bin/pip install -q -c constraints.txt -e "$target"
fi
# The project is installed editable, and neither installer compiles its bytecode: each process would compile the
# modules it imports (~0.2 s of CPU for a learner's).
.venv/bin/python -m compileall -q ddiloco >/dev/null
