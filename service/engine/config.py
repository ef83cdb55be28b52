"""The engine's configuration, checked before any GPU is touched: the vLLM version,
parallelism, architecture and layer ids (each refusal a StartupError with its reason), and
`build_engine_config`, which wires vLLM's `extract_hidden_states` speculative method to
hsx's connector and returns the `ModelFacts` every answer names."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from hsx.layers import default_layers
from hsx_service.engine import vllm_compat
from hsx_service.engine.arena import SharedArena
from hsx_service.engine.cpu_threads import bind_cpu_workers, reserve_cores_as_without_connector
from hsx_service.core.errors import StartupError
from hsx_service.settings import ServiceSettings

log = logging.getLogger("hsx.engine")


def check_vllm_version(version: str) -> None:
    if not vllm_compat.is_supported(version):
        raise StartupError(
            f"vLLM {version} is not supported: hsx needs vLLM {vllm_compat.supported_range()} "
            "(the extract_hidden_states method and the connector API it uses)."
        )


def check_parallelism(version: str, tensor_parallel: int, pipeline_parallel: int, data_parallel: int = 1) -> None:
    if pipeline_parallel > 1:
        raise StartupError(
            "pipeline parallel (--pipeline-parallel-size > 1) is not supported: vLLM's "
            "extract_hidden_states method does not support it. Use tensor parallel or replicas."
        )
    if tensor_parallel > 1 and not vllm_compat.supports_tp(version):
        raise StartupError(
            f"--tensor-parallel-size {tensor_parallel} needs vLLM >= {vllm_compat.TENSOR_PARALLEL_FROM} with "
            f"hidden-state extraction (vLLM {version} leaks KV blocks); use TP 1 replicas or upgrade vLLM."
        )
    if data_parallel > 1 and not vllm_compat.supports_dp(version):
        raise StartupError(
            f"--data-parallel-size {data_parallel} needs vLLM >= {vllm_compat.DATA_PARALLEL_FROM} with hidden-state "
            f"extraction (not verified on vLLM {version}); run one hsx serve per replica instead, or upgrade vLLM."
        )


def check_hybrid(version: str, arch: str, engine_args: Any, settings: ServiceSettings) -> None:
    """Hybrid (Mamba / linear-attention) models: only where their states were verified."""
    backend = vllm_compat.backend()
    if not vllm_compat.hybrid_verified(version, backend, arch):
        if not settings.allow_unverified_hybrid:
            raise StartupError(
                f"{arch} is a hybrid (Mamba / linear-attention) model, and hsx has not verified its hidden states on "
                f"vLLM {version} ({backend}): vLLM has returned all-zero states for hybrids without an error. "
                "See docs/compatibility.md; --allow-unverified-hybrid serves it anyway."
            )
        log.warning("serving unverified hybrid %s on vLLM %s (%s): compare its states with transformers",
                    arch, version, backend)
    if backend == "cpu":
        # vLLM's CPU build has no Triton, which hybrid prefix caching (mamba_cache_mode "align") needs.
        if engine_args.enable_prefix_caching:
            raise StartupError(f"{arch} on vLLM's CPU backend cannot use --enable-prefix-caching (it needs Triton)")
        if engine_args.enable_prefix_caching is None:
            log.info("%s on the CPU backend: prefix caching off (vLLM's hybrid prefix caching needs Triton)", arch)
            engine_args.enable_prefix_caching = False


def resolve_layers(requested: list[int] | None, n: int) -> list[int]:
    if not requested:
        return default_layers(n)
    bad = [k for k in requested if not 0 <= k <= n]
    if bad:
        raise StartupError(
            f"--layers {','.join(map(str, requested))}: ids {bad} are outside 0..{n} "
            f"(this model has {n} decoder layers; id k is the residual stream after k layers, "
            f"id {n} the last layer's output before the final norm)"
        )
    return sorted(set(requested))


# vLLM's DeepSeek-V2/V3 text model (also inside Kimi-K2.5 and Kimi-VL) captures an aux
# state as hidden_states + residual, and before the first layer the residual is None.
_NO_LAYER_ZERO_MODULES = ("deepseek_v2", "kimi_k25", "kimi_vl")


def check_layer_zero(model_cls: Any, arch: str, layers: list[int]) -> None:
    if 0 in layers and model_cls.__module__.rsplit(".", 1)[-1] in _NO_LAYER_ZERO_MODULES:
        raise StartupError(
            f"--layers: id 0 (the embeddings) cannot be captured from {arch} in vLLM: its forward adds a residual "
            "that does not exist before the first layer, and the engine would die at its first prefill. "
            "Use ids 1 and up."
        )


def avoid_wrong_cpu_rope(model_config: Any, engine_args: Any, arch: str) -> None:
    """MLA on the CPU backend: where vLLM's CPU rotary kernel rotates MLA's query/key views
    wrongly (hsx_service.engine.rope_probe), vLLM's PyTorch formula is used instead (the custom op off)."""
    if not (vllm_compat.is_cpu_backend() and getattr(model_config, "use_mla", False)):
        return
    from hsx_service.engine.rope_probe import mla_rope_error

    err = mla_rope_error()
    if err <= 1e-4:
        return
    cc = engine_args.compilation_config
    ops = cc.get("custom_ops", []) if isinstance(cc, dict) else cc.custom_ops
    if "+rotary_embedding" in ops:
        raise StartupError(
            f"{arch} (MLA) with the rotary_embedding custom op on: this vLLM's CPU rotary kernel rotates MLA's query "
            f"and key views wrongly (relative error {err:.2f} on a test tensor), so the hidden states would be wrong"
        )
    ops.append("-rotary_embedding")
    if isinstance(cc, dict):
        cc["custom_ops"] = ops
    log.info("%s (MLA) on the CPU backend: rotary embedding by vLLM's PyTorch formula (its CPU kernel rotates "
             "MLA's query and key views wrongly: relative error %.2f on a test tensor)", arch, err)


@dataclass
class ModelFacts:
    model: str
    revision: str | None
    served_model_name: str
    architecture: str
    num_hidden_layers: int
    hidden_size: int
    vocab_size: int
    dtype: str  # torch name without the prefix: bfloat16, float16, float32
    max_model_len: int
    layer_ids: list[int]
    tokenizer: str
    tokenizer_revision: str | None
    trust_remote_code: bool
    vllm_version: str


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def build_engine_config(engine_args: Any, settings: ServiceSettings, arena: SharedArena, notify_address: str,
                        credit_address: str | None = None):
    """Validate and return (VllmConfig, ModelFacts). Raises StartupError with the reason."""
    version = vllm_compat.installed_version()
    _check_engine_args(engine_args, version)
    model_cls, arch, n, layers = _capturable_model(engine_args, settings, version)
    hybrid = vllm_compat.is_hybrid(model_cls)
    _install_capture(engine_args, layers, arena, notify_address, credit_address)
    try:
        vllm_config = engine_args.create_engine_config()
    except Exception as exc:
        raise StartupError(f"vLLM rejected the engine settings: {exc}") from exc
    mc = vllm_config.model_config
    if hybrid and vllm_compat.is_cpu_backend() and _dtype_name(mc.dtype) != "bfloat16":
        raise StartupError(
            f"{arch} on vLLM's CPU backend needs --dtype bfloat16 (its Gated DeltaNet kernel takes no other dtype)"
        )
    return vllm_config, _model_facts(mc, arch, n, layers, version)


def _check_engine_args(engine_args: Any, version: str) -> None:
    """The vLLM release, the parallel layout (and the CPU workers' cores for it), and no
    flag that would take the place of hsx's own speculative or KV-transfer settings."""
    check_vllm_version(version)
    check_parallelism(version, engine_args.tensor_parallel_size, engine_args.pipeline_parallel_size,
                      engine_args.data_parallel_size)
    if vllm_compat.is_cpu_backend():
        try:
            bind_cpu_workers(engine_args.tensor_parallel_size * engine_args.data_parallel_size)
        except ValueError as exc:
            raise StartupError(f"tensor x data parallel ranks: {exc}") from exc
        reserve_cores_as_without_connector(engine_args.tensor_parallel_size * engine_args.pipeline_parallel_size)
    if getattr(engine_args, "speculative_config", None):
        raise StartupError("--speculative-config cannot be combined with hsx: it sets its own (extract_hidden_states)")
    if getattr(engine_args, "kv_transfer_config", None):
        raise StartupError("--kv-transfer-config cannot be combined with hsx: it installs its own connector")


def _capturable_model(engine_args: Any, settings: ServiceSettings, version: str) -> tuple[Any, str, int, list[int]]:
    """(model class, architecture, layer count, the layer ids to capture) of a model whose
    states vLLM can capture with these settings; StartupError says why not."""
    from vllm.model_executor.models.interfaces import supports_eagle3
    from vllm.model_executor.models.registry import ModelRegistry

    model = str(engine_args.model)
    if model.startswith((".", "/", "~")) and not os.path.isdir(os.path.expanduser(model)):
        raise StartupError(f"model directory {model!r} does not exist")
    try:
        model_config = engine_args.create_model_config()
    except Exception as exc:
        raise StartupError(f"cannot load model {model!r}: {' '.join(str(exc).split())[:600]}") from exc
    architectures = list(getattr(model_config.hf_config, "architectures", None) or [])
    try:
        model_cls, arch = ModelRegistry.resolve_model_cls(architectures, model_config)
    except Exception as exc:
        raise StartupError(f"vLLM cannot load architecture {architectures}: {exc}") from exc
    if not supports_eagle3(model_cls):
        raise StartupError(
            f"architecture {arch} does not implement vLLM's EAGLE-3 aux-hidden-state interface "
            "(SupportsEagle3), so its hidden states cannot be captured. Verified with hsx (docs/compatibility.md): "
            "Llama, Qwen3-MoE, Qwen3-Next, DeepSeek-V3 / Kimi-K2 (MLA), Kimi-K2.5 (its text path)."
        )
    if vllm_compat.is_hybrid(model_cls):
        check_hybrid(version, arch, engine_args, settings)
    n = int(model_config.hf_text_config.num_hidden_layers)
    layers = resolve_layers(settings.layers, n)
    check_layer_zero(model_cls, arch, layers)
    avoid_wrong_cpu_rope(model_config, engine_args, arch)
    return model_cls, arch, n, layers


def _install_capture(engine_args: Any, layers: list[int], arena: SharedArena, notify_address: str,
                     credit_address: str | None) -> None:
    """vLLM's extract_hidden_states for `layers`, and hsx's connector writing them to the arena."""
    engine_args.speculative_config = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layers}},
    }
    engine_args.kv_transfer_config = {
        "kv_connector": "HsxConnector",
        "kv_connector_module_path": "hsx_service.engine.connector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {
            "arena_path": arena.path,
            "arena_size": arena.size,
            "notify_address": notify_address,
            "credit_address": credit_address,
        },
    }


def _model_facts(mc: Any, arch: str, n: int, layers: list[int], version: str) -> ModelFacts:
    served = mc.served_model_name
    return ModelFacts(
        model=mc.model,
        revision=mc.revision,
        served_model_name=served[0] if isinstance(served, (list, tuple)) else str(served or mc.model),
        architecture=arch,
        num_hidden_layers=n,
        hidden_size=int(mc.get_hidden_size()),
        vocab_size=int(mc.get_vocab_size()),
        dtype=_dtype_name(mc.dtype),
        max_model_len=int(mc.max_model_len),
        layer_ids=layers,
        tokenizer=mc.tokenizer,
        tokenizer_revision=getattr(mc, "tokenizer_revision", None),
        trust_remote_code=bool(mc.trust_remote_code),
        vllm_version=version,
    )
