#!/usr/bin/env bash
# Install everything the tests need, then run them all (real vLLM CPU servers included).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh --test
# shellcheck disable=SC1091
. "${HSX_VENV:-.venv}/bin/activate"
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
# --durations: the slowest tests at the end of every run, so a test that grows slow shows.
# Two pytest workers (HSX_TEST_WORKERS; 0 runs in one process): a CPU engine's start is mostly
# one core's work, so a second worker uses the box's other core. tests/conftest.py groups
# the modules that share a server, so each server still starts once.
exec python -m pytest -q -ra --durations=25 -n "${HSX_TEST_WORKERS:-2}" --dist loadgroup --no-loadscope-reorder "$@"
