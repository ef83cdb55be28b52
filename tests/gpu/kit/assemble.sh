#!/usr/bin/env bash
# On the H200 machine, in the repository root, in the call that carries the kit's last part:
# checks that every part arrived (each earlier call copied its part to /tmp/gpukit), verifies
# the tarball's sha256, unpacks it into /tmp/site and links the image's CUDA libraries where
# torch's RUNPATH ($ORIGIN/../../nvidia/*/lib) looks for them. Then: . tests/gpu/kit/env.sh
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
read -r ver nparts < "$here/KIT"
stash=/tmp/gpukit
site=${GPUKIT_SITE:-/tmp/site}
want=$(cat "$here/kit.tar.zst.sha256")
if [ "$(cat "$site/.kit.sha256" 2>/dev/null)" = "$want" ]; then
    echo "assemble: vLLM $ver kit already in $site"
    exit 0
fi
mkdir -p "$stash"
cp -n "$here"/part* "$stash"/ 2>/dev/null || true
for d in .gpukit-"$ver"/p*; do cp -n "$d"/part* "$stash"/ 2>/dev/null || true; done  # parts still in the tree
have=$(ls "$stash"/part* 2>/dev/null | wc -l)
if [ "$have" -ne "$nparts" ]; then
    echo "assemble: $have of $nparts parts in $stash ($(ls "$stash" 2>/dev/null | tr '\n' ' ')); the machine was" \
         "given back between calls or a part was skipped: send the missing parts again" >&2
    exit 3
fi
t0=$(date +%s)
cat "$stash"/part* > "$stash/kit.tar.zst"  # part00, part01, ...: the glob sorts them
echo "$want  $stash/kit.tar.zst" | sha256sum -c --quiet
rm -f "$stash"/part*
rm -rf "$site" && mkdir -p "$site"
if [ -z "${GPUKIT_PY_ZSTD:-}" ] && command -v zstd >/dev/null; then  # GPUKIT_PY_ZSTD=1: the wheel path
    zstd -q -d --long=31 -c "$stash/kit.tar.zst" | tar -x -C "$site"
else
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$stash/boot" "$here"/zstandard-*.whl
    PYTHONPATH=$stash/boot python3 - "$stash/kit.tar.zst" "$site" <<'EOF'
import sys, tarfile, zstandard
with open(sys.argv[1], "rb") as f:
    r = zstandard.ZstdDecompressor(max_window_size=1 << 31).stream_reader(f)
    tarfile.open(fileobj=r, mode="r|").extractall(sys.argv[2], filter="fully_trusted")
EOF
fi
rm -f "$stash/kit.tar.zst"
# Tools the kit runs as programs (triton's ptxas, cuobjdump, ...) lost their exec bit on the
# way into the kit: inductor died with "Permission denied: .../triton/backends/nvidia/bin/ptxas"
# on the H200 (2026-12-01).
find "$site" -path '*/bin/*' -type f -exec chmod +x {} +
# The image's CUDA libraries serve torch 2.14 except NCCL, which the kit brings (tests/gpu/README.md).
host_sp=$(cd / && env -u PYTHONPATH python3 -c "import importlib.util, os
print(os.path.dirname(importlib.util.find_spec('torch').submodule_search_locations[0]))")
[ -d "$host_sp/nvidia" ] || { echo "assemble: no nvidia/ in $host_sp: the image's CUDA libraries are missing" >&2; exit 4; }
mkdir -p "$site/nvidia"
own=$(cd "$site/nvidia" && echo *)
linked=()
for d in "$host_sp"/nvidia/*/; do
    name=$(basename "$d")
    [ -e "$site/nvidia/$name" ] || { ln -s "${d%/}" "$site/nvidia/$name"; linked+=("$name"); }
done
echo "assemble: vLLM $ver kit in $site ($(du -sm "$site" | cut -f1) MiB, $(($(date +%s) - t0)) s);" \
     "from the kit: nvidia/$own; the image's, linked: ${linked[*]}"
echo "$want" > "$site/.kit.sha256"
PYTHONPATH=$site PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1 python3 - <<'EOF'
import torch, triton, vllm
x = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
print(f"assemble: torch {torch.__version__} (CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}, "
      f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}), triton {triton.__version__}, vllm {vllm.__version__}, "
      f"{torch.cuda.get_device_name(0)}: bf16 matmul ok {bool(torch.isfinite(x @ x).all())}")
EOF
