#!/usr/bin/env bash
# Download, once, the wheels experiments/device/check.sh installs on the accelerator machine (which reaches no
# package registry): the packages its image lacks (ml-collections, gguf) and our pins of flax and optax (the
# image's own versions differ). Pure-Python wheels, ~1 MiB, into .whl/ (git-ignored). From the repository root:
#   bash experiments/device/wheels.sh
# then carry ".whl" with the device run (see experiments/device/README.md).
set -euo pipefail
py=${PYTHON:-.venv/bin/python}
rm -rf .whl
# the versions pinned in requirements.txt
for spec in $(grep -E '^(flax|optax|ml-collections|gguf)==' requirements.txt); do
  "$py" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform any \
    -d .whl "$spec"
done
ls -l .whl && du -sh .whl
