#!/usr/bin/env bash
# Build an offline vLLM kit for the H200 machine (no registry there, at most 64 MiB per call).
#
#   bash tests/gpu/build_kit.sh 0.33.0        # reads tests/gpu/kit/vllm-0.33.0.txt
#
# Writes .gpukit-<ver>/p0 .. pN (git-ignored), one part per device call; the last one also holds
# assemble.sh, the boot wheel (zstandard), the tarball's sha256 and a manifest of every file.
# Run from the repository root on the development machine; ~1.5 GB download, ~20 min of one core
# (zstd -19). tests/gpu/README.md explains what is kept and why.
# Environment: GPUKIT_WORK (scratch, default /tmp/gpukit-work-<ver>), GPUKIT_PART_MIB (46),
# GPUKIT_ZSTD_LEVEL (19; 12 is ~10x faster and ~20% larger), GPUKIT_ARCH (90: keep sm_90/sm_90a GPU
# code only), GPUKIT_REUSE_SITE=1 (pack the tree a previous run left in $GPUKIT_WORK/site again).
set -euo pipefail
ver=${1:?usage: build_kit.sh VLLM_VERSION (a tests/gpu/kit/vllm-VERSION.txt must exist)}
here=$(cd "$(dirname "$0")" && pwd)
spec=$here/kit/vllm-$ver.txt
[ -f "$spec" ] || { echo "build_kit: no $spec; kits exist for: $(ls "$here"/kit/vllm-*.txt | sed 's/.*vllm-//; s/.txt//' | tr '\n' ' ')" >&2; exit 2; }
root=$(git rev-parse --show-toplevel)
kit=${GPUKIT_OUT:-$root/.gpukit-$ver}
work=${GPUKIT_WORK:-/tmp/gpukit-work-$ver}
part_mib=${GPUKIT_PART_MIB:-46}
level=${GPUKIT_ZSTD_LEVEL:-19}
arch=${GPUKIT_ARCH:-90}
for tool in zstd strip python3 split sha256sum; do
    command -v $tool >/dev/null || { echo "build_kit: $tool is needed (apt-get install zstd binutils)" >&2; exit 2; }
done

field() { awk -v k="$1" '$1 == k { for (i = 2; i <= NF && $i !~ /^#/; i++) print $i }' "$spec"; }
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64
      --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_5_x86_64)
py=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none)
site=$work/site
mkdir -p "$work/core" "$work/deps" "$work/boot"
# pip, with its output kept apart (this machine's pip.conf names local indexes that may be absent).
pipq() { python3 -m pip "$@" > "$work/pip.log" 2>&1 || { grep -v "is ignored: it is neither" "$work/pip.log" >&2; exit 1; }; }
if [ "${GPUKIT_REUSE_SITE:-0}" = 1 ] && [ -f "$work/site.done" ]; then
    echo "build_kit: packing the tree left in $site again"
else
rm -f "$work/site.done"
echo "build_kit: downloading (cached in $work) ..."
# shellcheck disable=SC2046
pipq download -q --no-deps "${py[@]}" "${plat[@]}" --platform manylinux_2_18_x86_64 -d "$work/core" $(field core)
# shellcheck disable=SC2046
pipq download -q --no-deps "${py[@]}" "${plat[@]}" -d "$work/deps" $(field deps)
# shellcheck disable=SC2046
pipq download -q --no-deps "${py[@]}" "${plat[@]}" -d "$work/boot" $(field boot)

rm -rf "$site" && mkdir -p "$site"
echo "build_kit: unpacking ..."
for w in "$work"/core/*.whl; do python3 -m zipfile -e "$w" "$site"; done  # these wheels have no .data dirs
pipq install -q --no-deps --no-compile --no-index --target "$site" "${py[@]}" "${plat[@]}" "$work"/deps/*.whl
rm -rf "${site:?}/bin"  # console scripts written for this machine's Python
for p in $(field drop); do
    [ -e "$site/$p" ] || { echo "build_kit: drop list names $p, which $ver does not have" >&2; exit 1; }
    rm -rf "${site:?}/$p"
done
# Triton discovers backends through entry points: the dropped ROCm backend must not be listed.
sed -i '/^amd = /d' "$site"/triton-*.dist-info/entry_points.txt
find "$site" -name __pycache__ -type d -prune -exec rm -rf {} +

echo "build_kit: pruning GPU code to sm_$arch and stripping symbol tables ..."
mapfile -t elfs < <(find "$site" -type f \( -name '*.so' -o -name '*.so.*' \) -exec sh -c 'head -c4 "$1" | grep -q ELF' _ {} \; -print | sort)
nice python3 "$here/kit/fatbin_prune.py" --arch "$arch" "${elfs[@]}"
# --strip-unneeded keeps the dynamic symbol table (all that linking and dlopen use); a file whose
# segments stripping would change is left as it was.
nice python3 "$here/kit/safe_strip.py" "${elfs[@]}"
touch "$work/site.done"
fi

echo "build_kit: packing (zstd -$level --long=31, one core) ..."
(cd "$site" && find . -type f -o -type l | sort | sed 's|^\./||') > "$work/files.txt"
tar -C "$site" --owner=0 --group=0 --numeric-owner --mtime=2026-01-01 -cf - -T "$work/files.txt" \
    | nice zstd -q -"$level" --long=31 -T1 -f -o "$work/kit.tar.zst"
rm -rf "$kit" && mkdir -p "$kit"
(cd "$kit" && split -b "${part_mib}m" -d -a 2 "$work/kit.tar.zst" part)
n=0
for f in "$kit"/part*; do mkdir -p "$kit/p$n"; mv "$f" "$kit/p$n/"; n=$((n + 1)); done
last=$kit/p$((n - 1))
cp "$here/kit/assemble.sh" "$work"/boot/*.whl "$last/"
sha256sum "$work/kit.tar.zst" | cut -d' ' -f1 > "$last/kit.tar.zst.sha256"
(cd "$site" && find . -type f | sort | xargs sha256sum) > "$last/manifest.sha256"
echo "$ver $n" > "$last/KIT"
grep -qx '/.gpukit-\*/' "$root/.gitignore" || echo "build_kit: add '/.gpukit-*/' to .gitignore" >&2
du -sm "$kit"/p* | sed "s|$root/||"
echo "build_kit: $(du -sm "$work/kit.tar.zst" | cut -f1) MiB in $n parts, $(wc -l < "$work/files.txt") files" \
     "($(du -sm "$site" | cut -f1) MiB unpacked); the last part (p$((n - 1))) holds assemble.sh"
