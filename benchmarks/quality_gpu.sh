#!/usr/bin/env bash
# Issue #26's quality plan on one GPU (docs/quality.md, "At GPU scale"): one command per step, each under 10 minutes.
# From the repository root:
#
#     bash benchmarks/quality_gpu.sh data_parallel   # one regime (or a comma-separated list of them)
#     bash benchmarks/quality_gpu.sh                 # every regime the results file does not hold yet at this code
#     bash benchmarks/quality_gpu.sh --dry-run       # the same plan at --quick sizes on the CPU, results in a temp dir
#
# Regimes: data_parallel, diloco, decoupled, decoupled_chaos. Each command first prepares the corpus (the installed
# packages' Python sources as BPE token shards, under ddiloco-runs/bench-data/; reused while the packages are the same),
# then trains the regimes asked for that benchmarks/results/quality_gpu.json does not already hold at this code and
# corpus, writing the file after every row. It ends by rewriting docs/quality-gpu-llama.png and the GPU block of
# docs/quality.md from every row the file holds (--publish). Bring those three files back and commit them; the next
# command, on this machine or a fresh one, goes on from them.
#
# On the device machine, with the wheels the image lacks in .whl/ (made here by `bash benchmarks/gpu_suite.sh
# --fetch-wheels`, see that script's header):
#     run(command="bash benchmarks/quality_gpu.sh decoupled; cp benchmarks/results/quality_gpu.json docs/quality.md \
#                  docs/quality-gpu-llama.png $OUT/", carry=[".whl"], timeout_s=600)
#
# Knobs (environment): QUALITY_GPU_OUT (--dry-run's results folder), GPU_SUITE_PYTHON, GPU_SUITE_SITE, GPU_SUITE_WHEELS
# (as for gpu_suite.sh).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1

DRY_RUN=0
ONLY=""
case "${1:-}" in
  --dry-run) DRY_RUN=1; ONLY="${2:-}" ;;
  -*) echo "usage: $0 [--dry-run] [REGIME[,REGIME...]]" >&2; exit 2 ;;
  *) ONLY="${1:-}" ;;
esac

source "$ROOT/benchmarks/gpu_env.sh"
GPU="$(gpu_name)"
if [[ "$DRY_RUN" != 1 && -z "$GPU" ]]; then
  echo "no GPU (nvidia-smi shows none): use --dry-run to run the plan at --quick sizes on the CPU" >&2
  exit 2
fi
PY=""
setup_python 240 || { echo "no Python for the plan (see benchmarks/gpu_env.sh)" >&2; exit 1; }

ARGS=(--scale gpu)
[[ -n "$ONLY" ]] && ARGS+=(--only "$ONLY")
if [[ "$DRY_RUN" == 1 ]]; then
  ARGS+=(--quick --device cpu --out "${QUALITY_GPU_OUT:-$(mktemp -d /tmp/quality-gpu-dry.XXXXXX)}")
else
  ARGS+=(--device cuda --publish)
fi
echo "== $(date -u +%FT%TZ) ${GPU:-CPU}, $(nproc) cores: $PY benchmarks/quality.py ${ARGS[*]}"
PYTHONUNBUFFERED=1 "$PY" benchmarks/quality.py "${ARGS[@]}"
