#!/usr/bin/env bash
# The one-shot accelerator check (≤ 8 minutes on one H200, whatever jax ≥ 0.10 the machine has). From the
# repository root, on the accelerator machine:
#   bash experiments/device/check.sh                 # results under $OUT (the device tool's) or experiments/device/out
#   bash experiments/device/check.sh --smoke         # tiny shapes on CPU: what `make test` runs
# Options: --out DIR (default $OUT, else experiments/device/out), --smoke, --wheels. PYTHON overrides the
# interpreter (default python3). Wheels under $WHEELS_DIR (default .whl/, experiments/device/wheels.sh) are
# installed first with --no-index (always on the device; with --smoke only when --wheels asks, as experiments/device/rehearse.sh does).
#
# Steps, each with its own time limit so that one hang cannot eat the others' time, each writing JSON:
#   0. lower_all.py   every Pallas kernel lowers for CUDA and TPU under this jax          lower.json
#   1+2. kernels      each Pallas kernel vs its reference on the device (max rel error); time XLA vs Pallas and
#                     % of roofline at Qwen2.5-1.5B and 7B layer shapes, T = 4096, r = 256  bench_<platform>.json/.png
#   4. sync_check.py  trainer and rollout weights bitwise equal after 5 synced low-rank updates   sync.json
#   3. step_check.py  the 1.5B RL train step: peak memory and median step time of AdamW (all), AdamW (targets)
#                     and LoGRA sketch-native with the KL probe (then with the Pallas kernels, time
#                     permitting), and the ratios                                                  step.json
#   summary.py        one table (printed last) and check.json with everything, device and jax version
set -uo pipefail
smoke=0
wheels=0
out=${OUT:-experiments/device/out}
whl=${WHEELS_DIR:-.whl}
while [ $# -gt 0 ]; do
  case "$1" in
    --smoke) smoke=1 ;;
    --wheels) wheels=1 ;;
    --out) out=$2; shift ;;
    *) echo "check.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
py=${PYTHON:-python3}
mkdir -p "$out"
log="$out/log.txt"
: > "$log"
started=$(date +%s)
say() { echo "[check $(( $(date +%s) - started ))s] $*" | tee -a "$log"; }

export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"
if { [ "$smoke" = 0 ] || [ "$wheels" = 1 ]; } && compgen -G "$whl/*.whl" > /dev/null; then
  say "installing $(ls "$whl" | wc -l) carried wheels (--no-index)"
  rm -rf /tmp/logra-site /tmp/logra-site-min
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/logra-site \
    "$whl"/*.whl >> "$log" 2>&1 || say "wheel install FAILED (see log.txt)"
  # our pins of flax/optax first; if they do not import under this jax, only what the image lacks
  if ! PYTHONPATH="/tmp/logra-site:$PYTHONPATH" "$py" -c "import logra_jax.job.optimizer_plan" >> "$log" 2>&1; then
    say "pinned flax/optax do not import here: using the image's, with ml-collections and gguf only"
    mkdir -p /tmp/logra-site-min && cp -r /tmp/logra-site/ml_collections* /tmp/logra-site/gguf* /tmp/logra-site-min/
    export PYTHONPATH="/tmp/logra-site-min:$PYTHONPATH"
  else
    export PYTHONPATH="/tmp/logra-site:$PYTHONPATH"
  fi
fi
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
if [ "$smoke" = 1 ]; then
  export JAX_PLATFORMS=cpu
  limits=(60 120 120 180)
  smoke_flag=(--smoke)
  bench_args=(--smoke --target gpu)
else
  limits=(30 160 70 230)  # lowering, kernels, sync, train steps: 490 s at most, ~6 min expected
  smoke_flag=()
  bench_args=(--budget-s 110)
fi
"$py" -c "import sys, jax, flax, optax; print('python', sys.version.split()[0], '| jax', jax.__version__, '| flax', \
flax.__version__, '| optax', optax.__version__, '|', jax.devices())" 2>&1 | tee -a "$log"
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm \
  --format=csv,noheader 2>&1 | tee -a "$log"

status_file="$out/exit_status.txt" kill_after=5
. "$(dirname "$0")/steps.sh"
rm -f "$status_file"
# from jax 0.11 the Triton lowering needs a GPU default device: let a GPU machine keep its cuda platform
lower_platforms=$([ "$smoke" = 1 ] && echo cpu || echo cuda,cpu)
step lower "${limits[0]}" env JAX_PLATFORMS="$lower_platforms" "$py" experiments/kernels/lower_all.py \
  --out "$out/lower.json"
step kernels "${limits[1]}" "$py" experiments/kernels/bench.py --out-dir "$out" "${bench_args[@]}"
# SmolLM2-135M shapes for the sync: the check is bitwise equality, which does not need a 1.5B model's snapshot
# hashing time; the step check is the 1.5B one. The Pallas contender runs last, only if time is left.
step sync "${limits[2]}" "$py" experiments/device/sync_check.py --out "$out/sync.json" --model smollm2-135m \
  "${smoke_flag[@]}"
step train_step "${limits[3]}" "$py" experiments/device/step_check.py --out "$out/step.json" \
  --budget-s $(( ${limits[3]} - 10 )) --timeout 80 \
  --contenders logra_sketch_native_kl adamw adamw_targets logra_sketch_native_kl_pallas "${smoke_flag[@]}"
"$py" experiments/device/summary.py "$out" 2>&1 | tee -a "$log"
rc=${PIPESTATUS[0]}
say "done in $(( $(date +%s) - started )) s"
exit "$rc"
