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

# `venv_compile VENV`: every module of VENV's site-packages compiled to bytecode, once, at
# install. uv installs none (pip compiles at install), and a process that may not write
# __pycache__ (PYTHONDONTWRITEBYTECODE=1, as on the 2-core box of bench/README.md, or a
# read-only venv) compiles every module it imports from source, each time: a tiny engine's
# start, three processes each importing torch and vLLM, took 86 s on one core without
# bytecode and 25 s with it (bench/README.md, "CI"). The few files this Python cannot compile
# (torch's tests written for a newer Python) stay as they are: compileall reports them and
# exits 1.
venv_compile() {
  local site
  site=$("$1/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  "$1/bin/python" -m compileall -q -j 0 "$site" >/dev/null 2>&1 || true
}
