#!/usr/bin/env bash
# Wheels the `draft` step of tests/gpu/session.sh (bench/draft_quality.py, issue 30) needs on the
# H200 beyond the vLLM kit and the image: speculators' (tests/gpu/online_wheels.sh, into
# .whl/online) and matplotlib's for the plot (into .whl/draft; without them the step still
# writes its JSON and says there is no plot). Run from the project root on the development
# machine; both folders are git-ignored and travel with `carry`.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
bash tests/gpu/online_wheels.sh
mkdir -p .whl/draft
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl/draft matplotlib contourpy cycler fonttools kiwisolver pyparsing python-dateutil six
du -sh .whl/online .whl/draft && ls .whl/draft
