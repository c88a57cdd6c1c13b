# The Python of a GPU machine, for the scripts that run there (gpu_suite.sh, quality_gpu.sh); sourced, not run.
# Their headers say why: the image's python3 holds a CUDA torch, and only what it lacks of the project's needs is
# installed, into a folder of its own (from .whl/ where no registry answers). A sourcing script sets ROOT (the
# repository root, its working directory), DRY_RUN (1: a CPU smoke run with .venv) and GPU (the GPU's name, or empty).

# What the GPU image lacks of the project's runtime and test needs (torch, transformers, numpy, pytest... it has).
# prometheus-client: the synchronizer (and so ddiloco.inprocess, which the GPU tests import) needs it.
MISSING_ON_IMAGE=(pydantic pydantic-settings "sqlalchemy>=2.0,<2.1" alembic tenacity "psycopg[binary]>=3.1" prometheus-client)

# PostgreSQL 16 binaries in a manylinux wheel (they need glibc and zlib only), for sync_sustain's ledger where the image
# has no server and no initdb: --fetch-wheels puts it in .whl/, setup_postgres unpacks it. Never pip-installed.
PG_WHEEL="pgserver==0.1.4"

setup_postgres() {   # puts an initdb on PATH where none is installed (the benchmarks' throwaway cluster needs one)
  local wheels="${GPU_SUITE_WHEELS:-$ROOT/.whl}" dest="${GPU_SUITE_PG:-/tmp/ddiloco-pg-bin}"
  local system="${GPU_SUITE_SYSTEM_PG:-/usr/lib/postgresql}" whl
  if command -v initdb >/dev/null || compgen -G "$system/*/bin/initdb" >/dev/null; then
    echo "postgresql: installed"; return 0
  fi
  whl="$(compgen -G "$wheels/pgserver-*.whl" | head -1)"
  [[ -n "$whl" ]] || { echo "postgresql: none installed and no pgserver wheel in $wheels (--fetch-wheels makes one)"; return 1; }
  rm -rf "$dest" && mkdir -p "$dest" || return 1
  # The binaries find their libraries (pgserver.libs/) and share/ by relative paths: both are unpacked, modes kept.
  python3 - "$whl" "$dest" <<'PYEOF' || return 1
import os, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    for info in z.infolist():
        if info.filename.startswith(("pgserver/pginstall/", "pgserver.libs/")):
            path = z.extract(info, sys.argv[2])
            mode = (info.external_attr >> 16) & 0o777
            if mode and not info.is_dir():
                os.chmod(path, mode | 0o444)
PYEOF
  chmod -R a+rX "$dest"
  export PATH="$dest/pgserver/pginstall/bin:$PATH"
  # initdb and pg_ctl refuse to run as root: the cluster runs them as 'postgres' (ddiloco/testing/postgres.py).
  if [[ "$(id -u)" == 0 ]] && ! id postgres >/dev/null 2>&1; then
    useradd --system --no-create-home --shell /usr/sbin/nologin postgres || { echo "postgresql: cannot add the postgres user"; return 1; }
  fi
  echo "postgresql: $(initdb --version) from $(basename "$whl")"
}

gpu_name() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1; }

setup_python() {   # sets PY (and PYTHONPATH on the GPU machine); $1: seconds it may take
  local limit="$1" site="${GPU_SUITE_SITE:-/tmp/ddiloco-site}" wheels="${GPU_SUITE_WHEELS:-$ROOT/.whl}"
  local probe='import sys, torch, ddiloco, pydantic, sqlalchemy, transformers; sys.exit(0 if torch.cuda.is_available() or sys.argv[1] == "cpu" else 3)'
  if [[ -n "${GPU_SUITE_PYTHON:-}" ]]; then PY="$GPU_SUITE_PYTHON"; echo "python: \$GPU_SUITE_PYTHON = $PY"; return 0; fi
  if [[ "$DRY_RUN" == 1 || -z "$GPU" ]]; then
    if [[ ! -x .venv/bin/python ]]; then
      echo "no .venv: the README's install"
      python3 -m venv .venv && timeout "$limit" .venv/bin/pip install -q -c constraints.txt -e ".[dev]" || return 1
    fi
    PY="$ROOT/.venv/bin/python"; echo "python: $PY (CPU)"; return 0
  fi
  if [[ -x .venv/bin/python ]] && .venv/bin/python -c "$probe" cuda 2>/dev/null; then
    PY="$ROOT/.venv/bin/python"; echo "python: $PY (its torch sees the GPU)"; return 0
  fi
  local sys_torch
  sys_torch="$(python3 -c 'import torch; print(torch.__version__ if torch.cuda.is_available() else "")' 2>/dev/null)"
  if [[ -z "$sys_torch" ]]; then echo "python3's torch does not see the GPU (or is missing): nothing to build on" >&2; return 1; fi
  echo "base: $(command -v python3) ($(python3 -V 2>&1)), torch $sys_torch; the project from $ROOT, what the image lacks from $site"
  export PYTHONPATH="$ROOT:$site${PYTHONPATH:+:$PYTHONPATH}"
  if ! python3 -c 'import pydantic, pydantic_settings, sqlalchemy, alembic, tenacity, psycopg, prometheus_client' 2>/dev/null; then
    local src=()
    if [[ -d "$wheels" ]]; then src=(--no-index --find-links "$wheels"); echo "offline: wheels from $wheels"; fi
    # Only what the image lacks, into a folder of its own: nothing of the image (its CUDA torch above all) is touched.
    timeout "$limit" python3 -m pip install -q --disable-pip-version-check --target "$site" "${src[@]}" \
      -c <(grep -v '^torch==' constraints.txt) "${MISSING_ON_IMAGE[@]}" || return 1
  fi
  python3 -c "$probe" cuda || { echo "python3 cannot import the project with a CUDA torch (PYTHONPATH=$PYTHONPATH)" >&2; return 1; }
  PY="$(command -v python3)"; echo "python: $PY (PYTHONPATH=$PYTHONPATH)"
}
