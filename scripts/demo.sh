#!/usr/bin/env bash
# The main job on an embedded default: install, then a CPU server on a small random
# model made on the spot, and the client writing a small speculators corpus.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
# shellcheck disable=SC1091
. "${HSX_VENV:-.venv}/bin/activate"
exec hsx demo "$@"
