# shellcheck shell=bash
# Source on the H200 machine after assemble.sh, in the repository root: `. tests/gpu/kit/env.sh`
# The assembled kit first, then hsx from this checkout (client/, service/ and tools/ linked under their
# package names, as `hsx bench` does for an uninstalled checkout).
mkdir -p /tmp/hsx-pkgs
ln -sfn "$PWD/client" /tmp/hsx-pkgs/hsx_client
ln -sfn "$PWD/service" /tmp/hsx-pkgs/hsx_service
ln -sfn "$PWD/tools" /tmp/hsx-pkgs/hsx_tools
# Wheels the image lacks, carried in .gpufix/wheels by `session.sh prepare` (httpx-aiohttp, xxhash).
if [ -d /tmp/gpufix/wheels ] && [ ! -d /tmp/hsx-pkgs/httpx_aiohttp ]; then
    python3 -m pip install -q --no-deps --no-index --target /tmp/hsx-pkgs /tmp/gpufix/wheels/*.whl
fi
export PYTHONPATH=/tmp/hsx-pkgs:${GPUKIT_SITE:-/tmp/site}:$PWD
# FlashInfer is not in the kit: vLLM's FlashInfer sampler must stay off (as with the 0.26 kit).
export VLLM_USE_FLASHINFER_SAMPLER=0
# torch 2.14 was built with cuDNN 9.24, the image has 9.19: every cuDNN symbol torch links is there,
# and nothing on the LLM path calls cuDNN; the variable only stops torch.backends.cudnn.version()
# from raising on the minor-version difference (tests/gpu/README.md).
export PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
