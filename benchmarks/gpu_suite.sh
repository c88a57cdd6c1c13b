#!/usr/bin/env bash
# The GPU suite (issue #25): every GPU check of the repository in ONE command, within 10 minutes of wall time,
# on a machine with one GPU (an H100 or H200 with 16 CPU cores). From the repository root:
#
#     bash benchmarks/gpu_suite.sh              # on the GPU machine: results under benchmarks/results/
#     bash benchmarks/gpu_suite.sh --plan       # print the budget plan and stop
#     bash benchmarks/gpu_suite.sh --dry-run    # (or GPU_SUITE_DRY_RUN=1) every step in its --quick CPU form, results in
#                                               # a temp dir: a smoke check of the suite on a machine without a GPU
#     bash benchmarks/gpu_suite.sh --fetch-wheels [DIR]   # on a machine WITH a package registry: see "Python" below
#     bash benchmarks/gpu_suite.sh --only cuda_tests,overhead_demo   # those steps only (with --plan or --dry-run too): a
#                                               # device lease of 15 minutes holds the whole suite or a part of it and a
#                                               # quality regime (benchmarks/quality_gpu.sh), not both whole
#
# Steps, in order, each under `timeout` (the cap in the plan), each run whatever the previous ones did:
#   1. cuda_tests           the tests written for a GPU (no marker: those whose skipif reason names CUDA or a GPU,
#                           selected by the plugin benchmarks/cuda_tests.py) -> gpu_suite_cuda_tests.json, rewritten
#                           after every test (with each test's seconds): a step cut at its cap keeps what ran
#   2. overhead_demo        learner_overhead.py --device cuda, the demo model, then 2 pairs with the link's I/O off
#                           -> learner_overhead_cuda.json
#   2a. overhead_demo_syncgpu  (extra: only with --only) overhead_demo with the synchronizer's merges on the GPU
#                           -> learner_overhead_cuda_syncauto.json
#   2b. overhead_demo_linkproc  the same with learners.link_process (the link's I/O in a process of its own)
#                           -> learner_overhead_cuda_linkproc.json
#   2c. upload_linger       (extra: only with --only) upload_linger.py --device cuda, the demo model at its benchmark
#                           batch: the learner with and without the upload linger in one run -> upload_linger_cuda.json
#   3. overhead_llama_ddp   the same on the 100 M-parameter Llama, learners.parallelism ddp
#                           -> learner_overhead_cuda_llama100m_ddp.json
#   3a. overhead_llama_syncgpu  (extra: only with --only) overhead_llama_ddp with the synchronizer's merges on the GPU
#                           -> learner_overhead_cuda_llama100m_ddp_syncauto.json
#   3a'. overhead_llama_devdecode  (extra: only with --only) overhead_llama_ddp with learners.decode_on_device
#                           -> learner_overhead_cuda_llama100m_ddp_devdecode.json
#   3b. overhead_llama_linkproc  ... with learners.link_process -> learner_overhead_cuda_llama100m_ddp_linkproc.json
#   4. overhead_llama_fsdp  ... and fsdp (at world 1) -> learner_overhead_cuda_llama100m_fsdp.json
#   5. largest_model        the largest Llama one learner trains on the GPU, ddp then fsdp -> largest_model_cuda.json
#   5a. largest_model_ac    (extra: only with --only) fsdp with and without activation checkpointing (full and
#                           selective), up to 1.2 B
#                           -> largest_model_cuda_ac.json
#   6. merge_cuda           merge_throughput.py --device cuda -> merge_throughput_cuda.json
#   7. sync_sustain         1 and 2 synchronizer shards in one invocation (the ratio from the same run) on the machine's
#                           cores -> sync_sustain_<N>cores.json (the published 2-core sync_sustain.json is left alone)
# then benchmarks/results/gpu_suite.json: per step its rc, status (passed / failed / timed out / not run), seconds,
# result file, and the machine (GPU name, nproc, load). A one-line-per-step summary ends the output. Every cap is a
# ceiling, not an estimate; their sum stays under SUITE_BUDGET_S (600 s, setup included), and a step never runs past
# the suite's deadline (its cap is cut to what is left). The caps stand 1.3-1.6x over what each step took on an H100
# (2026-11-27: setup 24 s, cuda_tests 42, overhead_demo 43, its link-process form 36, each Llama step 55, merge_cuda 20;
# largest_model 34 on 2026-11-26). sync_sustain's first point took 60 s on an H200 (2026-11-28, PostgreSQL's start and
# the blobs included) and the cap of 105 s cut the second: its windows are now 15 s after 6 s of warm-up (were 21 and
# 8). GPU time is short: the rest of a 15-minute device lease is for the quality plan.
#
# Python. The GPU machine has no package registry and its own CUDA build of torch: its python3 (Python 3.12, itself
# a venv at /opt/torch/.venv, torch 2.11.0+cu130, transformers, numpy, pytest, pytest-timeout) is the one to use.
# constraints.txt's torch==2.13.0 is the CPU build and must NOT be installed there, and a venv made from that
# python3 with --system-site-packages would NOT see its torch (a venv's "system" packages are those of the base
# interpreter, not of the venv it was made from). So on a GPU machine the suite uses $GPU_SUITE_PYTHON, else .venv
# when its torch sees the GPU and it imports the project, else python3 itself with the project on PYTHONPATH (the
# repository root: `python -m ddiloco` and every subprocess find it there) and what the image lacks (pydantic,
# pydantic-settings, sqlalchemy, alembic, tenacity, psycopg and their own needs) installed with
# `pip install --target /tmp/ddiloco-site` (also on PYTHONPATH): no package of the image is touched, the constraints
# apply without their torch pin, and torch is in no requirement of that list. The packages come from the registry
# where one answers, else from a wheel folder .whl/ in the repository root (pip --no-index --find-links). Make that
# folder here, where a registry answers, with `bash benchmarks/gpu_suite.sh --fetch-wheels` (cp312 manylinux
# x86-64 wheels, ~23 MB: 11 of them pgserver's PostgreSQL 16 binaries, unpacked by setup for sync_sustain's ledger
# where the image has no PostgreSQL, see gpu_env.sh), keep it out of git (`echo /.whl/ >> .git/info/exclude`) and
# carry it to the machine, with the logs in $OUT (a command its time limit kills returns no output; $OUT comes back):
#     run(command="export GPU_SUITE_LOGS=/tmp/gslogs; bash benchmarks/gpu_suite.sh 2>&1 | tee $OUT/gpu_suite.log;
#                  tar czf $OUT/gpu_suite.tgz benchmarks/results /tmp/gslogs", carry=[".whl"])
# With --dry-run (or no GPU) the suite uses .venv, made by the README's install when missing.
#
# Knobs (environment): GPU_SUITE_OUT (results folder), GPU_SUITE_LOGS (per-step logs; default a temp dir),
# GPU_SUITE_PYTHON, GPU_SUITE_SITE (default /tmp/ddiloco-site), GPU_SUITE_WHEELS (default .whl), GPU_SUITE_DRY_RUN=1,
# GPU_SUITE_PG (where setup unpacks PostgreSQL, default /tmp/ddiloco-pg-bin), GPU_SUITE_SYSTEM_PG (an installed one's root),
# GPU_SUITE_WHEEL_PY (--fetch-wheels' Python version, default 3.12: the GPU image's).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1

SUITE_BUDGET_S=600
DEADLINE_S=590            # the last step is cut short here, leaving time for the summary
DRY_RUN="${GPU_SUITE_DRY_RUN:-0}"
PLAN_ONLY=0
ONLY=""
usage="usage: $0 [--dry-run | --plan] [--only STEP[,STEP...]] | --fetch-wheels [DIR]"
while (( $# )); do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --plan) PLAN_ONLY=1 ;;
    --only) [[ -n "${2:-}" ]] || { echo "$usage" >&2; exit 2; }; ONLY="$2"; shift ;;
    --fetch-wheels) FETCH_DIR="${2:-.whl}"; break ;;
    *) echo "$usage" >&2; exit 2 ;;
  esac
  shift
done

# MISSING_ON_IMAGE, gpu_name and setup_python: the Python of a GPU machine, shared with benchmarks/quality_gpu.sh.
source "$ROOT/benchmarks/gpu_env.sh"

if [[ -n "${FETCH_DIR:-}" ]]; then
  mkdir -p "$FETCH_DIR"
  PIP=(python3 -m pip); [[ -x .venv/bin/pip ]] && PIP=(.venv/bin/pip)
  "${PIP[@]}" download -q --only-binary=:all: --python-version "${GPU_SUITE_WHEEL_PY:-3.12}" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d "$FETCH_DIR" "${MISSING_ON_IMAGE[@]}" || exit 1
  # Unpacked there for its PostgreSQL binaries, not installed: its own Python needs are not fetched.
  "${PIP[@]}" download -q --no-deps --only-binary=:all: --python-version "${GPU_SUITE_WHEEL_PY:-3.12}" --implementation cp \
    --platform manylinux2014_x86_64 -d "$FETCH_DIR" "$PG_WHEEL" || exit 1
  echo "wheels in $FETCH_DIR ($(du -sh "$FETCH_DIR" | cut -f1)): $(ls "$FETCH_DIR" | tr '\n' ' ')"
  echo "carry it to the GPU machine as .whl in the repository root; keep it out of git: echo /.whl/ >> .git/info/exclude"
  exit 0
fi

# --- the plan ------------------------------------------------------------------------------------------------
# name | cap (s) | result file (relative to the results folder) | GPU command | dry-run command ({PY} and {OUT} filled in)
NPROC="$(nproc 2>/dev/null || echo 1)"
STEPS=(
  "setup|35|-|(python environment: see the header)|(python environment)"
  "cuda_tests|60|gpu_suite_cuda_tests.json|{TESTS}|{TESTS}"
  "overhead_demo|55|learner_overhead_cuda.json|{PY} benchmarks/learner_overhead.py --device cuda --windows 4 --window-s 2.5 --warmup-s 4 --io-off-pairs 2 --json {OUT}/learner_overhead_cuda.json|{PY} benchmarks/learner_overhead.py --quick --json {OUT}/learner_overhead_cuda.json"
  "overhead_demo_syncgpu|55|learner_overhead_cuda_syncauto.json|{PY} benchmarks/learner_overhead.py --device cuda --sync-device auto --windows 4 --window-s 2.5 --warmup-s 4 --io-off-pairs 2 --json {OUT}/learner_overhead_cuda_syncauto.json|{PY} benchmarks/learner_overhead.py --quick --sync-device auto --json {OUT}/learner_overhead_cuda_syncauto.json"
  "overhead_demo_linkproc|45|learner_overhead_cuda_linkproc.json|{PY} benchmarks/learner_overhead.py --device cuda --link-process --windows 4 --window-s 2.5 --warmup-s 4 --json {OUT}/learner_overhead_cuda_linkproc.json|{PY} benchmarks/learner_overhead.py --quick --link-process --json {OUT}/learner_overhead_cuda_linkproc.json"
  "upload_linger|60|upload_linger_cuda.json|{PY} benchmarks/upload_linger.py --device cuda --batch-size 16 --seq-len 128 --rounds 4 --window-s 2.5 --warmup-s 4 --json {OUT}/upload_linger_cuda.json|{PY} benchmarks/upload_linger.py --quick --json {OUT}/upload_linger_cuda.json"
  "overhead_llama_ddp|75|learner_overhead_cuda_llama100m_ddp.json|{PY} benchmarks/learner_overhead.py --device cuda --model llama100m --parallelism ddp --windows 3 --window-s 3.5 --warmup-s 6 --json {OUT}/learner_overhead_cuda_llama100m_ddp.json|{PY} benchmarks/learner_overhead.py --quick --model llama100m --parallelism ddp --json {OUT}/learner_overhead_cuda_llama100m_ddp.json"
  "overhead_llama_syncgpu|70|learner_overhead_cuda_llama100m_ddp_syncauto.json|{PY} benchmarks/learner_overhead.py --device cuda --model llama100m --parallelism ddp --sync-device auto --windows 3 --window-s 3.5 --warmup-s 6 --json {OUT}/learner_overhead_cuda_llama100m_ddp_syncauto.json|{PY} benchmarks/learner_overhead.py --quick --model llama100m --parallelism ddp --sync-device auto --json {OUT}/learner_overhead_cuda_llama100m_ddp_syncauto.json"
  "overhead_llama_devdecode|70|learner_overhead_cuda_llama100m_ddp_devdecode.json|{PY} benchmarks/learner_overhead.py --device cuda --model llama100m --parallelism ddp --decode-on-device --windows 3 --window-s 3.5 --warmup-s 6 --json {OUT}/learner_overhead_cuda_llama100m_ddp_devdecode.json|{PY} benchmarks/learner_overhead.py --quick --model llama100m --parallelism ddp --decode-on-device --json {OUT}/learner_overhead_cuda_llama100m_ddp_devdecode.json"
  "overhead_llama_linkproc|70|learner_overhead_cuda_llama100m_ddp_linkproc.json|{PY} benchmarks/learner_overhead.py --device cuda --model llama100m --parallelism ddp --link-process --windows 3 --window-s 3.5 --warmup-s 6 --json {OUT}/learner_overhead_cuda_llama100m_ddp_linkproc.json|{PY} benchmarks/learner_overhead.py --quick --model llama100m --parallelism ddp --link-process --json {OUT}/learner_overhead_cuda_llama100m_ddp_linkproc.json"
  "overhead_llama_fsdp|75|learner_overhead_cuda_llama100m_fsdp.json|{PY} benchmarks/learner_overhead.py --device cuda --model llama100m --parallelism fsdp --windows 3 --window-s 3.5 --warmup-s 6 --json {OUT}/learner_overhead_cuda_llama100m_fsdp.json|{PY} benchmarks/learner_overhead.py --quick --model llama100m --parallelism fsdp --json {OUT}/learner_overhead_cuda_llama100m_fsdp.json"
  "largest_model|55|largest_model_cuda.json|{PY} benchmarks/largest_model.py --device cuda --parallelism ddp,fsdp --budget-s 45 --json {OUT}/largest_model_cuda.json|{PY} benchmarks/largest_model.py --quick --device cpu --json {OUT}/largest_model_cuda.json"
  "largest_model_ac|85|largest_model_cuda_ac.json|{PY} benchmarks/largest_model.py --device cuda --parallelism fsdp,fsdp+ac,fsdp+sac --max-params 1.3e9 --budget-s 25 --json {OUT}/largest_model_cuda_ac.json|{PY} benchmarks/largest_model.py --quick --device cpu --parallelism fsdp,fsdp+ac,fsdp+sac --json {OUT}/largest_model_cuda_ac.json"
  "merge_cuda|25|merge_throughput_cuda.json|{PY} benchmarks/merge_throughput.py --device cuda --rounds 3 --json {OUT}/merge_throughput_cuda.json|{PY} benchmarks/merge_throughput.py --quick --device cpu --json {OUT}/merge_throughput_cuda.json"
  "sync_sustain|105|sync_sustain_${NPROC}cores.json|{PY} benchmarks/sync_sustain.py --learners 32 --shards 1,2 --minutes 0.25 --warmup-s 6 --quiet --json {OUT}/sync_sustain_${NPROC}cores.json|{PY} benchmarks/sync_sustain.py --quick --shards 1,2 --json {OUT}/sync_sustain_${NPROC}cores.json"
)
# Extra steps run only when --only names them; the default suite and its budget leave them out. overhead_demo_syncgpu
# and overhead_llama_syncgpu are overhead_demo and overhead_llama_ddp with the benchmark's synchronizer merging on the
# learner's GPU (as every GPU row before 2026-12-06 did): beside their step in one --only, they say what sharing the
# GPU with it cost. overhead_llama_devdecode is overhead_llama_ddp with learners.decode_on_device (received versions
# decoded on the GPU), to decide that option's default. upload_linger compares the demo learner with its upload thread
# lingering for more sends (learners.upload_linger_s, the default) and not, round by round in one run. largest_model_ac is largest_model's fsdp with and without
# learners.activation_checkpoint (full, selective) up to 1.2 B parameters: what recomputing the activations costs in tokens/s (at one
# rank the parameters and AdamW state, 16 bytes a parameter, decide the largest size, not the activations).
EXTRA=" overhead_demo_syncgpu upload_linger overhead_llama_syncgpu overhead_llama_devdecode largest_model_ac "
# A dry run on a small shared CPU machine is slower than the GPU run: its caps are stretched, never its commands.
CAP_FACTOR=1; [[ "$DRY_RUN" == 1 ]] && CAP_FACTOR=3

field() { local IFS='|'; read -r -a f <<<"$1"; echo "${f[$2]}"; }

# --only: the steps a short device lease runs (setup always runs); the others are recorded as not asked for.
extra() { [[ "$EXTRA" == *" $1 "* ]]; }
asked() { [[ "$1" == setup || ",$ONLY," == *",$1,"* ]] || { [[ -z "$ONLY" ]] && ! extra "$1"; }; }
if [[ -n "$ONLY" ]]; then
  names=" $(for s in "${STEPS[@]}"; do printf '%s ' "$(field "$s" 0)"; done)"
  IFS=',' read -r -a wanted <<<"$ONLY"
  for w in "${wanted[@]}"; do
    [[ "$names" == *" $w "* && "$w" != setup ]] || { echo "--only: no step '$w' (steps:${names% })" >&2; exit 2; }
  done
fi

TOTAL_CAPS=0; ASKED_CAPS=0
for s in "${STEPS[@]}"; do
  extra "$(field "$s" 0)" || TOTAL_CAPS=$((TOTAL_CAPS + $(field "$s" 1)))
  asked "$(field "$s" 0)" && ASKED_CAPS=$((ASKED_CAPS + $(field "$s" 1)))
done
echo "== GPU suite: $([[ $DRY_RUN == 1 ]] && echo "DRY RUN (--quick CPU forms, caps x$CAP_FACTOR)" || echo "GPU run") on $(hostname), $NPROC cores"
echo "   budget plan (caps are ceilings; the suite's deadline is ${DEADLINE_S} s of ${SUITE_BUDGET_S} s):"
for s in "${STEPS[@]}"; do
  printf '   %-24s cap %4d s  -> %s%s\n' "$(field "$s" 0)" "$(( $(field "$s" 1) * CAP_FACTOR ))" "$(field "$s" 2)" \
    "$(asked "$(field "$s" 0)" || { extra "$(field "$s" 0)" && echo "  (extra: only when --only names it)"; } || echo "  (not in --only)")"
done
printf '   %-24s      %4d s  (must be <= %d)\n' "sum of caps" "$TOTAL_CAPS" "$SUITE_BUDGET_S"
[[ -n "$ONLY" ]] && printf '   %-24s      %4d s  (--only %s)\n' "of the steps asked" "$ASKED_CAPS" "$ONLY"
if (( TOTAL_CAPS > SUITE_BUDGET_S || ASKED_CAPS > SUITE_BUDGET_S )); then echo "the plan's caps exceed the budget" >&2; exit 2; fi
[[ "$PLAN_ONLY" == 1 ]] && exit 0

T0=$(date +%s)
elapsed() { echo $(( $(date +%s) - T0 )); }
if [[ "$DRY_RUN" == 1 ]]; then
  OUT="${GPU_SUITE_OUT:-$(mktemp -d /tmp/gpu-suite-dry.XXXXXX)}"   # never the published results
else
  OUT="${GPU_SUITE_OUT:-$ROOT/benchmarks/results}"
fi
LOGS="${GPU_SUITE_LOGS:-$(mktemp -d /tmp/gpu-suite-logs.XXXXXX)}"
mkdir -p "$OUT" "$LOGS"
ROWS="$LOGS/steps.tsv"; : >"$ROWS"
echo "   results -> $OUT; logs -> $LOGS"

GPU="$(gpu_name)"
LOAD_START="$(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null)"
if [[ "$DRY_RUN" != 1 && -z "$GPU" ]]; then
  echo "!! no GPU (nvidia-smi shows none): the GPU steps will fail; use --dry-run to smoke-test the suite here" >&2
fi

# --- running a step ------------------------------------------------------------------------------------------
summary_lines=()
record_step() {   # name rc status seconds result log command
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$@" >>"$ROWS"
  summary_lines+=("$(printf '%-24s %-30s rc %-4s %4d s  %s' "$1" "$3" "$2" "$4" "$5")")
}

run_step() {   # name cap result command
  local name="$1" cap="$2" result="$3" cmd="$4" log="$LOGS/$1.log"
  local left=$(( DEADLINE_S * CAP_FACTOR - $(elapsed) )) status rc t0 secs res="-"
  (( cap * CAP_FACTOR < left )) && left=$(( cap * CAP_FACTOR ))
  if (( left < 5 )); then
    record_step "$name" -1 "not run (suite budget spent)" 0 - - "$cmd"; return
  fi
  echo; echo "== [$(elapsed) s] $name (cap ${left} s): $cmd"
  t0=$(date +%s)
  if [[ "$name" == setup ]]; then
    setup_python "$left" >"$log" 2>&1; rc=$?
    [[ $rc -eq 0 && -z "$PY" ]] && rc=1
    # sync_sustain's ledger: without it that step says why and fails; the other steps need no PostgreSQL.
    [[ "$DRY_RUN" != 1 ]] && { setup_postgres >>"$log" 2>&1 || true; }
  else
    PYTHONUNBUFFERED=1 timeout --signal=TERM --kill-after=15 "$left" bash -c "$cmd" >"$log" 2>&1
    rc=$?
  fi
  secs=$(( $(date +%s) - t0 ))
  case $rc in
    0) status=passed ;;
    124|137) status="timed out" ;;
    *) status=failed ;;
  esac
  sed 's/^/   | /' "$log" | tail -n 8
  # A result counts only when this step wrote it (a failed step leaves an older file as it was).
  if [[ "$result" != "-" && -f "$OUT/$result" ]] && (( $(stat -c %Y "$OUT/$result") >= t0 )); then res="$OUT/$result"; fi
  record_step "$name" "$rc" "$status" "$secs" "$res" "$log" "$cmd"
}

PY=""
# Only the files with a GPU skip are collected: the others may import what the GPU image lacks (prefect, moto...). The
# plugin's module picks them from their source (a line grep missed a skipif laid over two lines). The step's bash
# expands $PYTHONPATH (the tests need the project's site folder that setup put there) and the file list. Four workers,
# as the step was timed (the repo's addopts give three, sized for a 2-core machine; this one has 16).
TESTS_CMD='CUDA_TESTS_JSON={OUT}/gpu_suite_cuda_tests.json PYTHONPATH="benchmarks${PYTHONPATH:+:$PYTHONPATH}" '
TESTS_CMD+='{PY} -m pytest -q -n 4 -p cuda_tests --timeout 120 $({PY} benchmarks/cuda_tests.py tests)'
for s in "${STEPS[@]}"; do
  name="$(field "$s" 0)"; cap="$(field "$s" 1)"; result="$(field "$s" 2)"
  if [[ "$DRY_RUN" == 1 ]]; then cmd="$(field "$s" 4)"; else cmd="$(field "$s" 3)"; fi
  cmd="${cmd//\{TESTS\}/$TESTS_CMD}"
  cmd="${cmd//\{PY\}/$PY}"; cmd="${cmd//\{OUT\}/$OUT}"
  if ! asked "$name"; then
    extra "$name" && continue  # an extra step not asked for leaves no row
    record_step "$name" -1 "not run (not in --only)" 0 - - "$cmd"; continue
  fi
  if [[ "$name" != setup && -z "$PY" ]]; then
    record_step "$name" -1 "not run (setup failed)" 0 - - "$cmd"; continue
  fi
  run_step "$name" "$cap" "$result" "$cmd"
done

# --- the record and the summary ----------------------------------------------------------------------------
TOTAL=$(elapsed)
REC_PY="${PY:-python3}"
"$REC_PY" - "$ROWS" "$OUT/gpu_suite.json" "$DRY_RUN" "$TOTAL" "$GPU" "$NPROC" "$LOAD_START" "$SUITE_BUDGET_S" "$LOGS" <<'EOF'
import json, os, subprocess, sys
from datetime import datetime, timezone
rows, out, dry, total, gpu, nproc, load_start, budget, logs = sys.argv[1:]
def git(*a):
    try:
        return subprocess.run(["git", *a], capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception:
        return None
steps = []
for line in open(rows):
    name, rc, status, secs, res, log, cmd = line.rstrip("\n").split("\t", 6)
    steps.append({"step": name, "rc": int(rc), "status": status, "seconds": int(secs),
                  "result": None if res == "-" else res, "command": cmd})
try:
    import torch
    torch_v = torch.__version__
except Exception:
    torch_v = None
record = {
    "benchmark": "gpu_suite", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    "commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--", "ddiloco", "benchmarks", ":(exclude)benchmarks/results")),
    "mode": "dry-run (--quick CPU forms)" if dry == "1" else "gpu",
    "machine": {"gpu": gpu or None, "nproc": int(nproc), "load_avg_start": load_start,
                "load_avg_end": " ".join(open("/proc/loadavg").read().split()[:3]), "python": sys.executable, "torch": torch_v},
    "budget_s": int(budget), "total_s": int(total), "steps": steps,
    "passed": sum(s["status"] == "passed" for s in steps), "of": len(steps),
}
# Paths relative to the repository root (the working directory): the record is committed, the machine's layout is not.
open(out, "w").write(json.dumps(record, indent=2).replace(os.getcwd() + "/", "") + "\n")
EOF
echo
echo "== GPU suite summary ($([[ $DRY_RUN == 1 ]] && echo dry run || echo GPU run); ${GPU:-no GPU}, $NPROC cores, load ${LOAD_START} -> $(cut -d' ' -f1-3 /proc/loadavg)): $TOTAL s of $SUITE_BUDGET_S"
for line in "${summary_lines[@]}"; do echo "  $line"; done
echo "  record: $OUT/gpu_suite.json; logs: $LOGS"
