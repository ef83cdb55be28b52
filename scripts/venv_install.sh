# shellcheck shell=bash
# Sourced by install.sh and compat.sh: `venv_install VENV PIP-INSTALL-ARGS...` installs into
# VENV with uv's pip interface when uv can be had (pip install uv, into VENV), else with pip.
# uv fetches and unpacks in parallel: a cold `.[cpu,test]` venv took 64 s against ~5 minutes
# with pip on the 2-core box (bench/README.md, "CI"). uv reads none of pip's configuration, so
# the find-links pip is given through the environment (PIP_FIND_LINKS: where the CPU torch
# wheel lies on the CI machines) are passed on. HSX_NO_UV=1 keeps pip.
venv_install() {
  local venv=$1
  shift
  if [ -z "${HSX_NO_UV:-}" ] && { [ -x "$venv/bin/uv" ] || "$venv/bin/python" -m pip install -q uv >/dev/null 2>&1; }; then
    local links=() dir
    for dir in ${PIP_FIND_LINKS:-}; do links+=(--find-links "$dir"); done
    "$venv/bin/uv" pip install -q --python "$venv/bin/python" "${links[@]}" "$@"
  else
    "$venv/bin/python" -m pip install -q "$@"
  fi
}
