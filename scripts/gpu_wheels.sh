#!/usr/bin/env bash
# Wheels of the packages the lent GPU machine lacks, for an offline install there (scripts/gpu_check.py).
#
# The GPU machine (python 3.12, x86_64, no network) has torch, triton, accelerate, transformers, peft,
# safetensors, torchmetrics, numpy, scipy, pillow and the rest, but not the packages below. Here, with
# network access, in the repository root:
#
#     bash scripts/gpu_wheels.sh            # -> .whl/ (git-ignored; never commit wheels)
#
# There, in the repository root, before running the check:
#
#     python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
#         && export PYTHONPATH=/tmp/site
#
# The wheels are the GPU machine's platform, not this one's (--python-version / --platform below), and
# --no-deps keeps pip from pulling anything the machine already has.
set -euo pipefail

DEST="${1:-.whl}"
PACKAGES=(diffusers==0.42.1 omegaconf==2.4.0 clean-fid==0.1.35 ftfy==6.3.1 wcwidth==0.9.4
          importlib_metadata==10.2.0)

for package in "${PACKAGES[@]}"; do
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$DEST" "$package"
done
ls -1 "$DEST"
