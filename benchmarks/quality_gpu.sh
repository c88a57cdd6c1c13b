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
#     run(command="bash benchmarks/quality_gpu.sh decoupled 2>&1 | tee $OUT/quality_gpu.log; cp benchmarks/results/quality_gpu.json \
#                  docs/quality.md docs/quality-gpu-llama.png $OUT/", carry=[".whl"], timeout_s=600)
# The log goes to $OUT as it is written: a command that its time limit kills returns no output, but $OUT comes back.
#
# The four rows compare only at one code (the sha256 of ddiloco/**/*.py), and a GPU session's 15 minutes of device time
# hold the suite or one regime: to go on with a plan whose first rows were trained at an older commit while the code moves on,
# freeze that commit's code here and carry it:
#     bash benchmarks/quality_gpu.sh --pin 878a4a6          # here (needs git): that commit's ddiloco/ in .quality-pin/
#     run(command="bash benchmarks/quality_gpu.sh --pinned diloco 2>&1 | tee $OUT/quality_gpu.log; cp \
#                  benchmarks/results/quality_gpu.json docs/quality.md docs/quality-gpu-llama.png $OUT/",
#         carry=[".whl", ".quality-pin"], timeout_s=600)
# --pinned trains with the code in .quality-pin/ (this script, its Python setup and the corpus are this checkout's) and
# publishes into this checkout (--repo): the rows and the docs block say which code trained them.
#
# Follow-up rows, trained only when named (`ddiloco bench quality --help` lists them): the decoupled and chaos rows with
# the best settings the plan's shape found on a CPU (benchmarks/few_rounds.py). The pin predates them, so they train at this
# checkout's code, beside a data-parallel row of the same code, into a folder of their own (QUALITY_GPU_OUT: on a GPU it
# replaces the published files, which stay as they are). One row a command; carry the folder to the next one:
#     run(command="QUALITY_GPU_OUT=ddiloco-runs/follow-up bash benchmarks/quality_gpu.sh data_parallel 2>&1 | tee \
#                  $OUT/quality_gpu.log; cp -r ddiloco-runs/follow-up $OUT/", carry=[".whl"], timeout_s=600)
#     (bring $OUT/follow-up back to ddiloco-runs/follow-up here; then the same with decoupled_h12_lr0.3_m0.95 and
#      carry=[".whl", "ddiloco-runs/follow-up"])
# Any row at another seed (model init, data order and outage schedule drawn again) is ROW_seed1 or ROW_seed2, trained only
# when named, with ratios to the same seed's data_parallel_seedN: data_parallel_seed1 and decoupled_seed1 say how far
# chance moves the plan's figure at this scale, as few_rounds.py --seed did on a CPU. The pin predates them too: train
# them as the follow-ups, with QUALITY_GPU_OUT, beside data_parallel and decoupled rows of the same code in that folder.
#
# --reference [ARGS] runs benchmarks/diloco_reference.py instead (its header says what), with the same Python and corpus:
# the diloco row against the same DiLoCo in plain torch and one learner alone. On the device machine:
#     run(command="bash benchmarks/quality_gpu.sh --reference --steps 480 --rows reference,single --json \
#                  $OUT/diloco_reference.json 2>&1 | tee $OUT/diloco_reference.log", carry=[".whl"], timeout_s=600)
# (--steps 96 with every row: the platform against the reference in ~3 minutes.) --dry-run --reference: its --quick form.
# --reference --steps 480 --rows platform --outer-warmup 5: the plan's diloco row with the outer lr warmed up (~6 min).
#
# Knobs (environment): QUALITY_GPU_OUT (the results folder: --dry-run's, or on a GPU instead of publishing),
# GPU_SUITE_PYTHON, GPU_SUITE_SITE, GPU_SUITE_WHEELS (as for gpu_suite.sh).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1

DRY_RUN=0
ONLY=""
PIN="$ROOT/.quality-pin"
CODE="$ROOT"
REFERENCE=0
usage="usage: $0 [--dry-run] [--pinned] [REGIME[,REGIME...] | --reference [ARGS]] | --pin COMMIT"
if [[ "${1:-}" == --pin ]]; then
  [[ -n "${2:-}" ]] || { echo "$usage" >&2; exit 2; }
  commit="$(git rev-parse --verify "$2^{commit}")" || exit 2
  rm -rf "$PIN" && mkdir -p "$PIN"
  git archive "$commit" ddiloco benchmarks/quality.py | tar -x -C "$PIN" || exit 1
  echo "$commit" >"$PIN/COMMIT"
  echo "the plan's code at $commit is in .quality-pin/ ($(du -sh "$PIN" | cut -f1)): carry it and run with --pinned"
  exit 0
fi
[[ "${1:-}" == --dry-run ]] && { DRY_RUN=1; shift; }
if [[ "${1:-}" == --pinned ]]; then
  [[ -f "$PIN/COMMIT" ]] || { echo "no .quality-pin/: make it with $0 --pin COMMIT" >&2; exit 2; }
  CODE="$PIN"; shift
fi
case "${1:-}" in
  --reference) REFERENCE=1; shift ;;
  -*) echo "$usage" >&2; exit 2 ;;
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

if [[ "$CODE" != "$ROOT" ]]; then
  # Ahead of the checkout's own package (PYTHONPATH or an editable install): the pinned ddiloco trains and is hashed.
  export PYTHONPATH="$CODE${PYTHONPATH:+:$PYTHONPATH}"
  echo "code: .quality-pin/ at $(cat "$PIN/COMMIT"), publishing into this checkout"
fi
if [[ "$REFERENCE" == 1 ]]; then
  REF=(--device cuda); [[ "$DRY_RUN" == 1 ]] && REF=(--device cpu --quick)
  echo "== $(date -u +%FT%TZ) ${GPU:-CPU}, $(nproc) cores: $PY benchmarks/diloco_reference.py ${REF[*]} $*"
  PYTHONUNBUFFERED=1 exec "$PY" "$ROOT/benchmarks/diloco_reference.py" "${REF[@]}" "$@"
fi
ARGS=(--scale gpu --repo "$ROOT")
[[ -n "$ONLY" ]] && ARGS+=(--only "$ONLY")
if [[ "$DRY_RUN" == 1 ]]; then
  ARGS+=(--quick --device cpu --out "${QUALITY_GPU_OUT:-$(mktemp -d /tmp/quality-gpu-dry.XXXXXX)}")
elif [[ -n "${QUALITY_GPU_OUT:-}" ]]; then
  ARGS+=(--device cuda --out "$QUALITY_GPU_OUT")
else
  ARGS+=(--device cuda --publish)
fi
echo "== $(date -u +%FT%TZ) ${GPU:-CPU}, $(nproc) cores: $PY ${CODE#"$ROOT"/}/benchmarks/quality.py ${ARGS[*]}"
# A row prints nothing until it ends (4-10 minutes): a line every 30 s says, in a log that a device call's time limit
# cut short, how far the command got and whether the GPU was busy.
T0=$(date +%s)
if [[ "$DRY_RUN" != 1 ]]; then
  ( while sleep 30 </dev/null >/dev/null 2>&1; do
      echo "   .. $(( $(date +%s) - T0 )) s: GPU $(nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader 2>/dev/null | head -1), load $(cut -d' ' -f1 /proc/loadavg)"
    done ) &
  BEAT=$!
  trap 'kill "$BEAT" 2>/dev/null' EXIT
fi
PYTHONUNBUFFERED=1 "$PY" "$CODE/benchmarks/quality.py" "${ARGS[@]}"
