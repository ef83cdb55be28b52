#!/usr/bin/env bash
# Install everything the tests need, then run them all (real vLLM CPU servers included).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh --test
# shellcheck disable=SC1091
. "${HSX_VENV:-.venv}/bin/activate"
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
# --durations: the slowest tests at the end of every run, so a test that grows slow shows.
exec python -m pytest -q -ra --durations=25 "$@"
