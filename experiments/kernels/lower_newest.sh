#!/usr/bin/env bash
# Lower every Pallas kernel (CUDA/Triton and TPU/Mosaic) under the NEWEST jax the package registry offers, in a
# scratch virtualenv (not our pins; not part of `make test`). Usage, from the repository root:
#   bash experiments/kernels/lower_newest.sh [VENV_DIR]      # default /tmp/logra-jax-newest
# Prints one line per kernel and the jax version; exits non-zero if a kernel fails to lower.
set -euo pipefail
venv=${1:-/tmp/logra-jax-newest}
python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip
"$venv/bin/python" -m pip install -q --disable-pip-version-check --upgrade jax jaxlib numpy
echo "newest on the registry: $("$venv/bin/python" -m pip index versions jax 2>/dev/null | head -1)"
PYTHONPATH="$(pwd)" "$venv/bin/python" experiments/kernels/lower_all.py --out "$venv/lower.json"
