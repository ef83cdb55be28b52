#!/usr/bin/env bash
# Install everything the tests need, then run them all (real vLLM CPU servers included).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh --test
# shellcheck disable=SC1091
. "${HSX_VENV:-.venv}/bin/activate"
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
# This checkout's modules as bytecode too (half a second), for the hundreds of `hsx` and server
# processes the tests start: see venv_compile in scripts/venv_install.sh.
python -m compileall -q hsx service client tools tests >/dev/null || true
# --durations: the slowest tests at the end of every run, so a test that grows slow shows.
# HSX_TEST_WORKERS=2 runs two pytest-xdist workers; tests/conftest.py groups the modules that
# share a server, so each server still starts once. One process by default: on the 2-core
# box two workers' engines (each binding its OpenMP threads to both cores) slowed each other
# down more than the second worker gained, and timing-bound tests failed (bench/README.md).
exec python -m pytest -q -ra --durations=25 -n "${HSX_TEST_WORKERS:-0}" --dist loadgroup --no-loadscope-reorder "$@"
