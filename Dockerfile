# hsx: the hidden-state extraction server on top of the official vLLM image.
#
#   docker build -t hsx:0.1.0 .
#   docker run --gpus all --shm-size 16g -p 8001:8001 \
#       -e HSX_API_KEY="$(cat key.txt)" -v "$HOME/.cache/huggingface:/home/hsx/.cache/huggingface" \
#       hsx:0.1.0 Qwen/Qwen3-8B --max-model-len 8192 --gpu-memory-utilization 0.9
#
# Arguments after the image name go to `hsx serve` (MODEL, then any vLLM engine flag,
# then hsx flags); every hsx flag is also an HSX_* environment variable (docs/deploy.md).
#
# The base is pinned to an exact vLLM release. Build on the release your production
# runs (0.26 - 0.33 supported; tensor parallel needs >= 0.31), e.g.
#   docker build --build-arg VLLM_IMAGE=vllm/vllm-openai:v0.31.0 -t hsx:0.1.0-vllm0.31 .
# On hosts with a CUDA 12 driver use the matching "-cu129" tag of the same release.
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0
FROM ${VLLM_IMAGE}

ARG HSX_UID=10001
ARG HSX_GID=10001

LABEL org.opencontainers.image.title="hsx" \
      org.opencontainers.image.description="Hidden-state extraction service (vLLM prefill-only) for EAGLE-3 draft training" \
      org.opencontainers.image.licenses="Apache-2.0"

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# A non-root user whose home holds the Hugging Face and vLLM caches (mount a volume
# on /home/hsx/.cache to keep downloaded weights across restarts).
RUN groupadd --gid "${HSX_GID}" hsx \
    && useradd --uid "${HSX_UID}" --gid "${HSX_GID}" --create-home --home-dir /home/hsx --shell /usr/sbin/nologin hsx \
    && mkdir -p /home/hsx/.cache/huggingface \
    && chown -R hsx:hsx /home/hsx

WORKDIR /opt/hsx/src
COPY pyproject.toml setup.py README.md LICENSE ./
COPY hsx ./hsx
COPY service ./service
COPY client ./client
COPY tools ./tools

# Install hsx with the server extra on top of the image's vLLM. Every package already in
# the image (vllm, torch, transformers, ...) is pinned by a constraints file made from the
# image itself, so this step adds packages and never replaces vLLM or its torch.
RUN python3 -m pip freeze --exclude-editable | grep -v ' @ ' > /tmp/image-constraints.txt \
    && python3 -m pip install --no-cache-dir --constraint /tmp/image-constraints.txt '.[serve]' \
    && rm -f /tmp/image-constraints.txt \
    && python3 -c "import vllm, hsx_service; print('vllm', vllm.__version__)" \
    && hsx --version

# Bytecode for every module of the image that lacks it (compileall skips what is compiled).
# The server runs as a user who may not write __pycache__ there, so a module without it is
# compiled from source by each of its processes (API server, engine core, a worker per rank)
# at every start: a tiny engine took 86 s to start on one CPU core that way, 25 s with
# bytecode (bench/README.md, "CI"). The few files this Python cannot compile stay as they are.
RUN python3 -c "import site; print('\\n'.join(site.getsitepackages()))" \
    | xargs python3 -m compileall -q -j 0 >/dev/null || true

ENV HOME=/home/hsx \
    HF_HOME=/home/hsx/.cache/huggingface \
    PYTHONUNBUFFERED=1 \
    HSX_HOST=0.0.0.0 \
    HSX_PORT=8001 \
    HSX_SHM_DIR=/dev/shm

# Numeric, so Kubernetes' runAsNonRoot can verify it (= HSX_UID:HSX_GID).
USER 10001:10001
WORKDIR /home/hsx

EXPOSE 8001

# Liveness only: /health answers 503 once the engine is dead. Loading a large model takes
# many minutes, which the start period covers (failures then do not count).
HEALTHCHECK --interval=30s --timeout=10s --start-period=30m --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('HSX_PORT', '8001'), timeout=8)"]

# The base image's entrypoint is `vllm serve`; replace it. MODEL may come from HSX_MODEL
# instead of the first argument, extra engine flags from HSX_ENGINE_ARGS.
ENTRYPOINT ["hsx", "serve"]
CMD []
