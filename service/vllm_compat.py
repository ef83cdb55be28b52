"""Every difference between vLLM releases that hsx depends on, in one place.

Other modules ask questions here and never compare versions themselves.
(This branch's part: the hidden-states cache layout and the model runner; the
CPU-side questions live beside these once the branches are merged.)
"""

from __future__ import annotations

from packaging.version import Version

# vLLM 0.29 moved the block-offset axis of the hidden-states layer's KV cache view
# from 1 ([blocks, block_size, layers, hidden]) to 2 ([blocks, layers, block_size,
# hidden]), read in each release's ExampleHiddenStatesConnector.extract_from_kv_cache
# (kv_cache.shape[1] in 0.26.0 - 0.28.0, kv_cache.shape[2] in 0.29.0 - 0.33.0).
HIDDEN_STATES_BLOCK_AXIS_2_FROM = Version("0.29.0")
# The same release made Model Runner V2 run extract_hidden_states on CUDA by default (0.26 -
# 0.28 list the method among MRV2's unsupported features and use the V1 runner).
CUDA_RUNNER_V2_FROM = Version("0.29.0")


def release(version: str) -> Version:
    """The release a version string belongs to: '0.33.0rc1.dev5+g12' -> 0.33.0."""
    return Version(Version(version).base_version)


def hidden_states_block_axis(version: str) -> int:
    """Axis of the block offset in the hidden-states cache view of this vLLM release."""
    return 2 if release(version) >= HIDDEN_STATES_BLOCK_AXIS_2_FROM else 1


def cuda_default_runner(version: str) -> str:
    """'v2' or 'v1': the model runner vLLM picks on CUDA for hsx's engine settings."""
    return "v2" if release(version) >= CUDA_RUNNER_V2_FROM else "v1"


def model_runner_name(caller_module: str) -> str:
    """Which model runner registered the KV caches, from the registering module:
    Model Runner V2 (vllm.v1.worker.gpu.*, the CUDA default from vLLM 0.29 for
    extract_hidden_states) or the V1 runner (vllm.v1.worker.gpu_model_runner, which the
    CPU runner extends)."""
    if caller_module.startswith("vllm.v1.worker.gpu."):
        return "Model Runner V2"
    if caller_module.startswith("vllm.v1.worker."):
        return "V1 model runner"
    return f"unknown runner ({caller_module})"
