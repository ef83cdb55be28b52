#!/usr/bin/env bash
# One H200 session for a vLLM kit, in steps of one device call each (tests/gpu/README.md has the plan).
#
# Here, on the development machine, once:
#   bash tests/gpu/session.sh prepare 0.33.0      # builds the kit if absent, copies fixtures, prints the calls
# There, on the H200 machine, one step per `run` call, in the repository root:
#   bash tests/gpu/session.sh stash 0.33.0 K      # carry .gpukit-0.33.0/pK (and .gpufix in the first)
#   bash tests/gpu/session.sh check 0.33.0        # carry the last part: assemble, load check, check_cuda
#   bash tests/gpu/session.sh extra 0.33.0        # stories260K chats, tiny MoE and hybrid, every layer
#   bash tests/gpu/session.sh mla 0.26.0          # tiny DeepSeek-V3 and Kimi-K2.5 (MLA + MoE), bf16 and fp8, every layer
#   bash tests/gpu/session.sh bench 0.33.0        # hsx bench --h200
#   bash tests/gpu/session.sh mla|quant|bitequal 0.26.0   # issue 27: MLA, quantized, bit-equality vs vLLM's own path
#   bash tests/gpu/session.sh long 0.33.0         # issue 29: 128K-token, hidden-7168 samples through the default arena
#   bash tests/gpu/session.sh regen 0.33.0        # issue 28: hsx regenerate on hsx serve vs vllm serve (8B shape)
#   bash tests/gpu/session.sh draft 0.33.0        # issue 30: drafts trained on hsx vs reference data, acceptance
#     (.whl/online and .whl/draft from tests/gpu/draft_wheels.sh carried by stash calls; DRAFT_ARGS adds flags)
#   bash tests/gpu/session.sh images 0.33.0       # issue 41: tiny Kimi-K2.5 and Qwen2.5-VL image chats, bf16, every layer
#   bash tests/gpu/session.sh imagebench 0.33.0   # issue 41: hsx bench --image-chat on a Qwen2.5-VL-7B shape
#   bash tests/gpu/session.sh onepass 0.33.0      # issue 41: one-pass vs two-pass vs vllm serve + hsx extract (8B)
#   bash tests/gpu/session.sh bench17 0.33.0 preset|8b [WORKERS [HTTP_WORKERS]]   # issue 17's HTTP rows
#     (MODES=c skips plain prefill; SERVER_ARGS="--zstd-frame-threads=2" adds hsx serve flags)
# Results land in $OUT (check-*.json, bench-*.json, logs). Consecutive calls must follow within the
# machine's 30 s warm time: /tmp (the stashed parts, the assembled kit) goes with the machine.
set -euo pipefail
step=${1:?usage: session.sh prepare|stash|check|extra|mla|bench|draft|bench17 VERSION [PART | SHAPE WORKERS]}
ver=${2:?vLLM version, e.g. 0.33.0}
kit=.gpukit-$ver
out=${OUT:-/tmp/out}
# The bench steps' common flags: the client in its own process tree, no codec study, the
# corpus in /dev/shm, a 16 GiB arena.
remote_bench=(--client-process --codec-sample 0 --workdir /tmp/hsxb --output-dir /dev/shm/hsxc
              --server-arg=--arena-bytes=17179869184)
# The runner check_cuda expects: vLLM's CUDA default for this release (hsx_service.engine.vllm_compat).
# Diagnosis only: RUNNER=v1 makes vLLM >= 0.29 use its V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0),
# to tell an MRV2 problem from anything else in the same session.
[ "${RUNNER:-}" = v1 ] && export VLLM_USE_V2_MODEL_RUNNER=0
# The 8B Llama shape with vLLM's dummy weights and hsx's small tokenizer (vocab 1024, so every
# generated id detokenizes), made once: the regen and one-pass benches generate on it.
regen_llama8b() {
    local model=/tmp/regen-llama8b
    [ -f "$model/config.json" ] || python3 -c "from hsx_tools.tiny_model import make_tiny_model; make_tiny_model(
        '$model', 'llama', num_layers=32, hidden_size=4096, intermediate_size=14336, num_heads=32, num_kv_heads=8,
        vocab_size=1024, max_position_embeddings=4096, dtype='bfloat16', weights=False)" >&2 || return 1
    echo "$model"
}
expected_runner() {
    if [ "${RUNNER:-}" = v1 ]; then echo v1; return; fi
    python3 -c "from hsx_service.engine import vllm_compat; print(vllm_compat.cuda_default_runner('$ver'))"
}

case $step in
prepare)
    [ -f "$kit/p0/part00" ] || bash tests/gpu/build_kit.sh "$ver"
    fx=../shared/fixtures
    rm -rf .gpufix && mkdir -p .gpufix
    cp -r "$fx/models/stories260K" .gpufix/
    cp "$fx/chat/oasst/threads.messages.jsonl" .gpufix/
    cp "$fx/chat_templates/llama3.jinja" .gpufix/
    # The real-photo fixture of tests/_image_chats.py (matplotlib's sample photograph, MRI slice,
    # drawing) for the images step: the GPU image need not have matplotlib.
    mkdir -p .gpufix/images
    "${HSX_PYTHON:-python3}" -c "import sys; sys.path.insert(0, 'tests'); from pathlib import Path
from _image_chats import IMAGES, image_bytes
for n in IMAGES: Path('.gpufix/images', n).write_bytes(image_bytes(n))"
    # Pure-Python wheels hsx needs that neither the image nor the kit has: HsxClient's transport
    # (client/transport.py) and the server's tokenizer processes (service/tokenize_pool.py).
    python3 -m pip download -q --no-deps --only-binary=:all: -d .gpufix/wheels "httpx-aiohttp>=0.2" "pebble>=5.0" \
        "loguru>=0.7.2,<=0.7.3"  # compressed-tensors (hsx quantize-tiny-model, vLLM's quantization configs) imports it
    # vLLM >= 0.33's OpenAI server imports its SageMaker router's package at start (`vllm serve`,
    # the regen step's baseline), which the kit lacks.
    python3 -m pip download -q --no-deps --only-binary=:all: -d .gpufix/wheels model-hosting-container-standards \
        jmespath "supervisor>=4.2.0"
    # ... and the corpus checksums' xxhash (client/corpus/store.py), a binary wheel for the image's Python.
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .gpufix/wheels "xxhash>=3.0"
    grep -qx '/.gpufix/' .gitignore || echo "session: add '/.gpufix/' to .gitignore" >&2
    last=$(($(ls -d "$kit"/p* | wc -l) - 1))
    echo "device calls (kind nvidia-h200, back to back):"
    for k in $(seq 0 $((last - 1))); do
        extra=$([ "$k" = 0 ] && echo ', ".gpufix"' || true)
        echo "  run(command='bash tests/gpu/session.sh stash $ver $k', carry=[\"$kit/p$k\"$extra], timeout_s=120)"
    done
    echo "  run(command='bash tests/gpu/session.sh check $ver', carry=[\"$kit/p$last\"], timeout_s=600)"
    echo "  run(command='bash tests/gpu/session.sh extra $ver', timeout_s=600)"
    echo "  run(command='bash tests/gpu/session.sh bench $ver', timeout_s=600)"
    du -sm "$kit"/p* .gpufix
    ;;
stash)
    k=${3:?part number}
    mkdir -p /tmp/gpukit "$out"
    cp "$kit/p$k"/part* /tmp/gpukit/
    [ -d .gpufix ] && { rm -rf /tmp/gpufix; cp -r .gpufix /tmp/gpufix; }
    for w in online draft; do  # the draft step's wheels (tests/gpu/draft_wheels.sh), carried beside any part
        if [ -d ".whl/$w" ]; then mkdir -p /tmp/whl && rm -rf "/tmp/whl/$w" && cp -r ".whl/$w" /tmp/whl/; fi
    done
    if [ "$k" = 0 ]; then  # the facts the kit's analysis assumes, read off this image
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
        python3 -m pip show torch triton nvidia-nccl-cu13 nvidia-cudnn-cu13 nvidia-cusparselt-cu13 nvidia-cublas \
            nvidia-nvshmem-cu13 cuda-bindings nvidia-cuda-runtime transformers 2>/dev/null | grep -E "^(Name|Version)" \
            | paste - - | tee "$out/image-packages.txt"
        python3 -m pip show pillow numba llvmlite einops opencv-python-headless numpy 2>/dev/null \
            | grep -E "^(Name|Version)" | paste - - | tee -a "$out/image-packages.txt"
        command -v zstd || echo "no zstd CLI: assemble.sh uses the zstandard wheel"
    fi
    ls -la /tmp/gpukit
    ;;
check)
    last=$(ls -d "$kit"/p* | sort -V | tail -1)
    bash "$last/assemble.sh" 2>&1 | tee "$out/assemble-$ver.log"
    # shellcheck disable=SC1091
    . tests/gpu/kit/env.sh
    python3 tests/gpu/kit/load_check.py /tmp/site 2>&1 | tee "$out/load-check-$ver.log"
    # CHECK_CUDA=0: assemble and load check only (when this kit's check_cuda rows are on record)
    [ "${CHECK_CUDA:-1}" = 0 ] && exit 0
    runner=$(expected_runner)
    python3 tests/gpu/check_cuda.py --expect-runner "$runner" --json "$out/check-$ver.json" 2>&1 \
        | tee "$out/check-$ver.log"
    ;;
images)
    # Issue 41 item 1: the tiny Kimi-K2.5 (MoonViT + MLA MoE) and Qwen2.5-VL in bf16, chats with one
    # and several images (the real-photo fixture carried in .gpufix/images), every layer against
    # transformers fp32; hostile images refused while text is answered (tests/gpu/check_images.py).
    # shellcheck disable=SC1091
    . tests/gpu/kit/env.sh
    runner=$(expected_runner)
    # shellcheck disable=SC2086
    python3 tests/gpu/check_images.py --fixture /tmp/gpufix/images --expect-runner "$runner" ${IMAGES_ARGS:-} \
        --json "$out/check-images-$ver.json" 2>&1 | tee "$out/check-images-$ver.log"
    cp /tmp/hsx-gpu-images-*/*.log "$out/" 2>/dev/null || true
    ;;
imagebench)
    # Issue 41 item 2: hsx bench --image-chat on a Qwen2.5-VL-7B shape (28 x 3584 text, a 32-block
    # 1280-wide ViT, vocab 152064; vLLM's dummy weights): vLLM's own LLM.chat prefill of the same
    # chats, then hsx serve by same-host leases, HTTP identity and zstd, --workers client processes.
    # shellcheck disable=SC1091
    . tests/gpu/kit/env.sh
    qvl="family=qwen2_5_vl,layers=28,hidden=3584,ffn=18944,heads=28,kv_heads=4,vocab=152064,dtype=bfloat16"
    qvl="$qvl,max_pos=4096,weights=0,vit_depth=32,vit_hidden=1280,vit_ffn=3420,vit_heads=16"
    # shellcheck disable=SC2086
    python3 -m hsx_tools.cli bench --image-chat --make-model "$qvl" --dtype bfloat16 --max-model-len 4096 \
        --chats "${IMAGE_CHATS:-512}" --warmup 32 --concurrency "${IMAGE_CONCURRENCY:-32}" --workers "${IMAGE_WORKERS:-8}" \
        --layers 2,14,25,28 --transfer "${TRANSFER:-auto,http:none,http:zstd}" --engine-arg=--load-format=dummy \
        --engine-arg=--gpu-memory-utilization=0.85 --engine-arg=--max-num-batched-tokens=16384 \
        --server-arg=--arena-bytes=17179869184 --workdir /tmp/hsxb-image --keep ${IMAGEBENCH_ARGS:-} \
        --out "$out/imagebench-$ver.json" 2>&1 | tee "$out/imagebench-$ver.log"
    cp /tmp/hsxb-image/*.log "$out/" 2>/dev/null || true
    ;;
onepass)
    # Issue 41 item 3: bench/regen_one_pass.py on the 8B Llama shape (vLLM's dummy weights, hsx's small
    # tokenizer as the regen step): hsx regenerate alone, one pass (--extract-to), two passes on hsx
    # serve, and hsx regenerate on plain vllm serve then hsx extract of it; generated tokens/s of hsx
    # serve vs vllm serve from the same client.
    # shellcheck disable=SC1091
    . tests/gpu/kit/env.sh
    model=$(regen_llama8b)
    # shellcheck disable=SC2086
    python3 bench/regen_one_pass.py --model "$model" --input /tmp/gpufix/threads.messages.jsonl \
        --engine-args "--load-format dummy --dtype bfloat16 --max-model-len 4096 --gpu-memory-utilization 0.85" \
        --hsx-args "--layers 2,16,29,32" --layers 2,16,29,32 --vllm-arm --warmup 16 \
        --conversations "${ONEPASS_CONVERSATIONS:-256}" --prompt-chars "${ONEPASS_PROMPT_CHARS:-2000}" \
        --max-tokens "${ONEPASS_MAX_TOKENS:-256}" --concurrency 128 --keep-logs "$out" ${ONEPASS_ARGS:-} \
        --out "$out/onepass-$ver.json" 2>&1 | tee "$out/onepass-$ver.log"
    ;;
extra)
    # shellcheck disable=SC1091
    . tests/gpu/kit/env.sh
    models=()
    for fam in qwen3_moe qwen3_next; do  # hsx make-tiny-model --family (issue 12, item 4)
        if python3 -m hsx_tools.cli make-tiny-model "/tmp/tiny-$fam" --family "$fam" --dtype bfloat16 >/dev/null 2>&1; then
            models+=(--extra-model "/tmp/tiny-$fam")
        else
            echo "session: this hsx's make-tiny-model has no --family $fam: skipped"
        fi
    done
    # Hybrids are refused unless verified; this run is the verification (where this hsx has the flag).
    grep -q allow-unverified-hybrid service/*.py && models+=(--extra-serve-arg=--allow-unverified-hybrid)
    # As verified on CPU (issue 12 item 4): hybrids with prefix caching off.
    models+=(--extra-serve-arg=--no-enable-prefix-caching)
    fx=/tmp/gpufix
    runner=$(expected_runner)
    python3 tests/gpu/check_cuda.py --skip-random --expect-runner "$runner" --stories "$fx/stories260K" \
        --chats "$fx/threads.messages.jsonl" --template "$fx/llama3.jinja" "${models[@]}" \
        --json "$out/check-extra-$ver.json" 2>&1 | tee "$out/check-extra-$ver.log"
    ;;
mla)
    # Issue 27: the tiny DeepSeek-V3 (MLA with DeepSeek's head sizes, noaux_tc MoE), 16 heads as
    # vLLM's Hopper MLA kernels are used to; bf16, then fp8 weights quantized on the fly, every
    # layer id 1..N against transformers fp32 (worst errors in the JSON).
    # shellcheck disable=SC1091
    . tests/gpu/kit/env.sh
    # MLA_ONLY=kimi: the Kimi-K2.5 model alone, bf16 (when the DeepSeek-V3 rows of this kit are on record).
    deepseek=(--extra-model /tmp/tiny-deepseek-v3 --extra-quantization fp8)
    if [ "${MLA_ONLY:-}" = kimi ]; then
        deepseek=()
    else
        python3 -m hsx_tools.cli make-tiny-model /tmp/tiny-deepseek-v3 --family deepseek_v3 --layers 4 --heads 16 \
            --dtype bfloat16 >/dev/null
    fi
    # Kimi-K2.5 (KimiK25ForConditionalGeneration: the same text model behind a MoonViT), its text path.
    kimi=()
    if python3 -m hsx_tools.cli make-tiny-model /tmp/tiny-kimi-k25 --family kimi_k25 --layers 4 --heads 16 \
        --dtype bfloat16 >/dev/null 2>&1; then
        kimi=(--extra-model /tmp/tiny-kimi-k25)
    else
        echo "session: this hsx's make-tiny-model has no --family kimi_k25 (or its transformers no Kimi-K2.5): skipped"
    fi
    runner=$(expected_runner)
    tag=$([ "${MLA_ONLY:-}" = kimi ] && echo kimi || echo mla)
    python3 tests/gpu/check_cuda.py --skip-random --expect-runner "$runner" "${deepseek[@]}" "${kimi[@]}" \
        --json "$out/check-$tag-$ver.json" 2>&1 | tee "$out/check-$tag-$ver.log"
    # Which MLA / prefill / MoE backends vLLM picked, from the servers' logs.
    grep -hiE "backend|quantiz" /tmp/hsx-gpu-check-*/tiny-deepseek-v3*.log /tmp/hsx-gpu-check-*/tiny-kimi-k25*.log \
        > "$out/mla-backends-$ver.txt" 2>/dev/null || true
    ;;
quant)
    # Issue 27: quantized checkpoints (block-FP8, W4A16 Machete and Marlin, FP8 on the fly) of the
    # tiny Llama and DeepSeek-V3, every layer against transformers on the dequantized twin.
    # shellcheck disable=SC1091
    . tests/gpu/kit/env.sh
    python3 tests/gpu/check_quant.py --json "$out/check-quant-$ver.json" 2>&1 | tee "$out/check-quant-$ver.log"
    ;;
bitequal)
    # Issue 27 item 5: hsx's states against vLLM's own extract_hidden_states (stock file connector),
    # same flags and prompts: stories260K in fp32, the tiny DeepSeek-V3 (made by the mla step) in bf16.
    # shellcheck disable=SC1091
    . tests/gpu/kit/env.sh
    # fp32: vLLM's own path twice (fresh processes), to tell the kernels' run-to-run bits from hsx's.
    # BITEQUAL=stories runs the fp32 stories260K check alone.
    python3 tests/gpu/check_bitequal.py --model /tmp/gpufix/stories260K --dtype float32 --own-runs 2 \
        --json "$out/bitequal-stories-fp32-$ver.json" 2>&1 | tee "$out/bitequal-stories-$ver.log" || true
    [ "${BITEQUAL:-}" = stories ] && exit 0
    [ -d /tmp/tiny-deepseek-v3 ] || python3 -m hsx_tools.cli make-tiny-model /tmp/tiny-deepseek-v3 --family deepseek_v3 \
        --layers 4 --heads 16 --dtype bfloat16 >/dev/null
    python3 tests/gpu/check_bitequal.py --model /tmp/tiny-deepseek-v3 --dtype bfloat16 \
        --json "$out/bitequal-deepseek-bf16-$ver.json" 2>&1 | tee "$out/bitequal-deepseek-$ver.log"
    ;;
regen)
    # Issue 28 item 6: generated tokens/s of `hsx regenerate` on hsx serve's engine against the same
    # client on plain `vllm serve`, same flags and conversations (the OASST threads), greedy; then the
    # chained extract (bench/regen_throughput.py). The 8B Llama shape with vLLM's dummy weights and
    # hsx's small tokenizer (vocab 1024, so every generated id detokenizes). REGEN_ARGS=--spec-arm adds
    # vllm serve with hsx's speculative config (the method's own cost, apart from hsx's).
    # shellcheck disable=SC1091
    . tests/gpu/kit/env.sh
    model=$(regen_llama8b)
    python3 bench/regen_throughput.py --model "$model" --input /tmp/gpufix/threads.messages.jsonl \
        --engine-args "--load-format dummy --max-model-len 4096 --gpu-memory-utilization 0.85" \
        --conversations "${REGEN_CONVERSATIONS:-256}" --max-tokens "${REGEN_MAX_TOKENS:-256}" --concurrency 128 \
        ${REGEN_ARGS:-} --out "$out/regen-throughput-h200-$ver.json" 2>&1 | tee "$out/regen-throughput-h200-$ver.log"
    ;;
long)
    # Issue 29 item 4: 131,072-token prompts on a random DeepSeek-V3-shaped model (hidden 7168, MLA,
    # 4 layers, vLLM dummy weights): ~7.5 GB of states per sample with every layer captured, through
    # the DEFAULT arena (no --arena-bytes), by leases and HTTP, against plain prefill of the same
    # prompts; hsx bench reports server and client peak RSS. The corpus on disk, not /dev/shm: one
    # measured prompt and one warm-up by default (~15 GB of corpus per transfer mode).
    # shellcheck disable=SC1091
    . tests/gpu/kit/env.sh
    ds="family=deepseek_v3,layers=4,hidden=7168,ffn=18432,moe_ffn=2048,experts=8,topk=2,q_lora=1536,heads=128"
    ds="$ds,kv_heads=128,vocab=129280,dtype=bfloat16,max_pos=131200,weights=0"
    python3 -m hsx_tools.cli bench --make-model "$ds" --prompts "${LONG_PROMPTS:-1}" --prompt-len 131072 \
        --layers 1,2,3,4 --concurrency 1 --warmup 1 --max-model-len 131200 --engine-arg=--load-format=dummy \
        --engine-arg=--max-num-batched-tokens=16384 --engine-arg=--gpu-memory-utilization=0.85 --modes "${MODES:-a,c}" \
        --transfer "${TRANSFER:-auto,http:none}" --client-process --codec-sample 0 --workdir /tmp/hsxb \
        --output-dir /tmp/hsxc-long --out "$out/long-128k-$ver.json" 2>&1 | tee "$out/long-128k-$ver.log"
    ;;
bench)
    # shellcheck disable=SC1091
    . tests/gpu/kit/env.sh
    # Issue 12's preset on this release; every (c) coding against one server, the client in its
    # own process tree over TCP (issue 17's remote path, loopback standing in for the network).
    python3 -m hsx_tools.cli bench --h200 --modes a,c --transfer auto,http:none,http:bf16split,http:zstd "${remote_bench[@]}" \
        --out "$out/bench-h200-$ver.json" 2>&1 | tee "$out/bench-h200-$ver.log"
    ;;
draft)
    # Issue 30: the same EAGLE-3 draft trained by speculators on hsx's offline corpus, hsx's online
    # backend, vLLM's own extract_hidden_states files and the target's regenerated chats (hsx
    # regenerate), two seeds each, then served with the target (stories260K, the fixture chats)
    # through vLLM's EAGLE-3 speculative decoding on held-out prompts (bench/draft_quality.py).
    # Rerunnable: a second call continues in /tmp/draftq where the first ran out of time. It
    # stops itself DRAFT_CALL_S (default 570) seconds after the call's shell started (the
    # kit's assembly in the same call included), so its logs land in $OUT before the call's
    # limit; exit 124 then means "call it again".
    # shellcheck disable=SC1091
    . tests/gpu/kit/env.sh
    for w in online draft; do  # stashed by the stash calls that carried .whl/online and .whl/draft
        if [ -d "/tmp/whl/$w" ] && [ ! -e "/tmp/site-$w/.done" ]; then
            python3 -m pip install -q --no-deps --no-index --target "/tmp/site-$w" /tmp/whl/$w/*.whl
            touch "/tmp/site-$w/.done"
        fi
    done
    export PYTHONPATH=$PYTHONPATH:/tmp/site-online:/tmp/site-draft
    fx=/tmp/gpufix
    rc=0
    # the call's time already spent: its shell's age (the kit's assembly before this step), when
    # the parent is that shell; else nothing is counted (a long-lived runner is no call)
    spent=0
    if [[ "$(ps -o comm= -p $PPID 2>/dev/null)" =~ ^(bash|sh|dash)$ ]]; then
        spent=$(ps -o etimes= -p $PPID | tr -d " ") || spent=0
        [ "${spent:-0}" -lt 600 ] 2>/dev/null || spent=0
    fi
    left=$(( ${DRAFT_CALL_S:-570} - ${spent:-0} ))
    mkdir -p "$out"
    # timeout signals the whole process group: the trainers and engines stop with the driver.
    # shellcheck disable=SC2086
    timeout -k 20 $((left > 60 ? left : 60)) python3 bench/draft_quality.py --model "$fx/stories260K" \
        --chats "$fx/threads.messages.jsonl" --template "$fx/llama3.jinja" --workdir /tmp/draftq --regenerate \
        --engine-arg=--gpu-memory-utilization=0.3 --engine-arg=--enforce-eager \
        --label "H200, vLLM $ver: stories260K, OASST threads" ${DRAFT_ARGS:-} \
        --out "$out/draft-quality-h200-$ver.json" 2>&1 | tee -a "$out/draft-quality-h200-$ver.log" || rc=$?
    cp /tmp/draftq/*.log /tmp/draftq/timings.json "$out/" 2>/dev/null || true  # each step's own log, for a failure
    [ "$rc" = 124 ] && echo "session.sh draft: out of this call's time; call it again (continues in /tmp/draftq)" >&2
    exit $rc
    ;;
bench17)
    # Issue 17's rows: the remote path (identity and zstd) with `--workers N` client processes,
    # each against its own plain baseline (a); run once with WORKERS=1 for the ratio.
    # shellcheck disable=SC1091
    . tests/gpu/kit/env.sh
    shape=${3:?preset or 8b}
    workers=${4:-8}
    http_workers=${5:-auto}  # hsx serve --http-workers (auto: the server's default)
    server=()
    [ "$http_workers" = auto ] || server=(--server-arg="--http-workers=$http_workers")
    # More hsx serve flags, e.g. SERVER_ARGS="--zstd-frame-threads=2" (one --server-arg each).
    for a in ${SERVER_ARGS:-}; do server+=(--server-arg="$a"); done
    if [ "$shape" = 8b ]; then
        llama8b="layers=32,hidden=4096,ffn=14336,heads=32,kv_heads=8,vocab=128256,dtype=bfloat16,max_pos=4096"
        model=(--make-model "$llama8b" --prompts 128 --prompt-len 2048 --layers "2,16,29,32" --concurrency 64 --warmup 16
               --engine-arg=--max-num-batched-tokens=16384 --engine-arg=--gpu-memory-utilization=0.85)
    else
        model=(--h200)
    fi
    tag=$shape-w$workers-h$http_workers-$ver
    python3 -m hsx_tools.cli bench "${model[@]}" --modes "${MODES:-a,c}" --transfer "${TRANSFER:-http:none,http:zstd}" \
        "${remote_bench[@]}" "${server[@]}" --workers "$workers" --out "$out/bench17-$tag.json" 2>&1 \
        | tee "$out/bench17-$tag.log"
    ;;
benchds)
    # Issue 27 item 4: a DeepSeek-V3 / Kimi-K2-shaped target (hidden 7168, MLA with DeepSeek's head
    # sizes and q_lora 1536, 128 heads, sigmoid noaux_tc MoE with 2048-wide experts, 8 per token + 1
    # shared, the first layer dense with an 18432-wide MLP, vocab 129280) cut to what one H200 holds
    # in bf16 with room for the KV cache: 12 layers, 64 routed experts (~70 GB of weights). vLLM's
    # dummy weights (no 70 GB checkpoint to write); layers [2, N//2, N-3, N] as the issue asks.
    # Leases and HTTP (identity, zstd) against plain prefill in the same process.
    # shellcheck disable=SC1091
    . tests/gpu/kit/env.sh
    workers=${3:-16}
    ds="family=deepseek_v3,layers=12,hidden=7168,ffn=18432,moe_ffn=2048,experts=64,topk=8,q_lora=1536,heads=128"
    ds="$ds,kv_heads=128,vocab=129280,dtype=bfloat16,max_pos=4096,weights=0"
    python3 -m hsx_tools.cli bench --make-model "$ds" --prompts 128 --prompt-len 2048 --layers 2,6,9,12 --concurrency 64 \
        --warmup 16 --engine-arg=--load-format=dummy --engine-arg=--max-num-batched-tokens=16384 \
        --engine-arg=--gpu-memory-utilization=0.85 --modes "${MODES:-a,c}" \
        --transfer "${TRANSFER:-auto,http:none,http:zstd}" "${remote_bench[@]}" --workers "$workers" \
        --out "$out/benchds-w$workers-$ver.json" 2>&1 | tee "$out/benchds-w$workers-$ver.log"
    ;;
*)
    echo "session.sh: unknown step $step (prepare, stash, check, extra, images, imagebench, onepass, mla, quant, bitequal, regen, long, bench, bench17, benchds, draft)" >&2
    exit 2
    ;;
esac
