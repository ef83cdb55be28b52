#!/usr/bin/env bash
# Wheels that tests/gpu/online_train.py needs on the H200 beyond the vLLM kit (shared/gpu-kit)
# and the machine's image (KINDS.md, "Python packages already there"): speculators and
# hs-connectors (installed without their dependency sets, as scripts/install.sh does) and
# the runtime packages of speculators that the image lacks. Pure-Python, ~3 MiB in all.
# Run from the project root on the development machine; writes .whl/online (git-ignored).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
mkdir -p .whl/online
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl/online \
    speculators==0.9.0 hs-connectors==0.9.0 datasets==5.1.0 multiprocess==0.70.19 loguru==0.7.3
du -sh .whl/online && ls .whl/online
