"""The engine: vLLM's AsyncLLM set up for prefill-only hidden-state capture.

`build_engine_config` checks what can be refused before any GPU is touched
(vLLM version, parallelism, architecture, layer ids) and wires the
`extract_hidden_states` speculative method to hsx's connector. `PrefillEngine` runs
one request: reserve an arena range (a `Reservation`), prefill with max_tokens=1, wait
for the worker's copy notice; the range is then the HTTP layer's to send and release.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import tempfile
from pathlib import Path
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hsx.dtypes import by_name as dtype_by_name
from hsx.layers import default_layers
from hsx.protocol import KV_PARAMS_KEY
from hsx_service.engine import vllm_compat
from hsx_service.engine.arena import Allocator, ArenaFull, ArenaTooSmall, Reservation, SharedArena
from hsx_service.engine.cpu_threads import bind_cpu_workers
from hsx_service.engine.engine_output import ChildOutput
from hsx_service.engine.engine_stats import EngineStats
from hsx_service.http.errors import BadInput, EngineFailure, EngineTimeout, Overloaded, StartupError, TooLarge
from hsx_service.settings import ServiceSettings

if TYPE_CHECKING:  # vLLM is imported when the engine starts, not with this module
    from vllm.config import VllmConfig
    from vllm.v1.engine.async_llm import AsyncLLM

log = logging.getLogger("hsx.engine")
SELF_TEST_TIMEOUT = 120.0  # seconds the start-up self-test may take (it is the first prefill)


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


def build_engine_config(engine_args: Any, settings: ServiceSettings, arena: SharedArena, notify_address: str):
    """Validate and return (VllmConfig, ModelFacts). Raises StartupError with the reason."""
    from vllm.model_executor.models.interfaces import supports_eagle3
    from vllm.model_executor.models.registry import ModelRegistry

    version = vllm_compat.installed_version()
    check_vllm_version(version)
    check_parallelism(version, engine_args.tensor_parallel_size, engine_args.pipeline_parallel_size,
                      engine_args.data_parallel_size)
    if vllm_compat.is_cpu_backend():
        try:
            bind_cpu_workers(engine_args.tensor_parallel_size * engine_args.data_parallel_size)
        except ValueError as exc:
            raise StartupError(f"tensor x data parallel ranks: {exc}") from exc
    if getattr(engine_args, "speculative_config", None):
        raise StartupError("--speculative-config cannot be combined with hsx: it sets its own (extract_hidden_states)")
    if getattr(engine_args, "kv_transfer_config", None):
        raise StartupError("--kv-transfer-config cannot be combined with hsx: it installs its own connector")

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
            "Llama, Qwen3-MoE, Qwen3-Next, DeepSeek-V3 (MLA)."
        )
    hybrid = vllm_compat.is_hybrid(model_cls)
    if hybrid:
        check_hybrid(version, arch, engine_args, settings)
    text_config = model_config.hf_text_config
    n = int(text_config.num_hidden_layers)
    layers = resolve_layers(settings.layers, n)
    check_layer_zero(model_cls, arch, layers)
    avoid_wrong_cpu_rope(model_config, engine_args, arch)

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
        },
    }
    try:
        vllm_config = engine_args.create_engine_config()
    except Exception as exc:
        raise StartupError(f"vLLM rejected the engine settings: {exc}") from exc
    mc = vllm_config.model_config
    if hybrid and vllm_compat.is_cpu_backend() and _dtype_name(mc.dtype) != "bfloat16":
        raise StartupError(
            f"{arch} on vLLM's CPU backend needs --dtype bfloat16 (its Gated DeltaNet kernel takes no other dtype)"
        )
    served = mc.served_model_name
    facts = ModelFacts(
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
    return vllm_config, facts


class Notices:
    """PULL side of the completion channel: one future per submitted request key."""

    def __init__(self) -> None:
        import zmq
        import zmq.asyncio

        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.PULL)
        remove_stale_notify_sockets(tempfile.gettempdir())
        self.address = f"ipc://{tempfile.gettempdir()}/hsx-notify-{os.getpid()}-{uuid.uuid4().hex[:8]}.sock"
        self._sock.bind(self.address)
        self._waiters: dict[str, asyncio.Future] = {}
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="hsx-notices")

    def expect(self, key: str) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        self._waiters[key] = fut
        return fut

    async def _run(self) -> None:
        while True:
            msg = json.loads(await self._sock.recv())
            fut = self._waiters.pop(msg["key"], None)
            if fut is not None and not fut.done():
                fut.set_result(msg)

    def fail_all(self, error: str) -> None:
        """The engine died: no notice will come for anything in flight."""
        for fut in self._waiters.values():
            if not fut.done():
                fut.set_result({"key": None, "ok": False, "error": error})
        self._waiters.clear()

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self._sock.close(linger=0)
        self._ctx.term()
        path = self.address.removeprefix("ipc://")
        if os.path.exists(path):
            os.unlink(path)


def remove_stale_notify_sockets(directory: str) -> list[str]:
    """The notice sockets of hsx servers that died without closing theirs (SIGKILL):
    their names hold the server's pid; this user's whose pid is gone are removed."""
    removed = []
    for path in Path(directory).glob("hsx-notify-*-*.sock"):
        try:
            pid = int(path.name.split("-")[2])
            if path.stat().st_uid != os.getuid() or pid == os.getpid():
                continue
            os.kill(pid, 0)  # alive (or another user's): keep it
        except ProcessLookupError:
            path.unlink(missing_ok=True)
            removed.append(str(path))
        except (ValueError, OSError):
            continue
    return removed


class PrefillEngine:
    """Owns the AsyncLLM, the arena and the notices; one `extract` per request."""

    def __init__(self, settings: ServiceSettings, engine_args: Any):
        self.settings = settings
        self._engine_args = engine_args
        self.arena: SharedArena | None = None
        self.allocator: Allocator | None = None
        self.notices: Notices | None = None
        self.engine: AsyncLLM | None = None
        self.facts: ModelFacts | None = None
        self.itemsize = 2
        self.engine_running = 0  # requests submitted to the engine and not yet finished
        self.vllm_config: VllmConfig | None = None
        self.text_config: Any = None  # the model's transformers text config
        self.stats = EngineStats()
        self.child_output = ChildOutput()  # the engine's own exception line when it fails

    def engine_said(self) -> str:
        """'; the engine said: ValueError: ...' when a child process printed an exception."""
        cause = self.child_output.cause()
        return f"; the engine said: {cause}" if cause else ""

    def prepare(self) -> None:
        """Fast checks and set-up, before the port opens. Raises StartupError."""
        self.arena = SharedArena.create(self.settings.shm_dir, self.settings.arena_bytes)
        self.allocator = Allocator(self.arena.size)
        self.notices = Notices()
        self.vllm_config, self.facts = build_engine_config(
            self._engine_args, self.settings, self.arena, self.notices.address
        )
        self.text_config = self.vllm_config.model_config.hf_text_config
        self.itemsize = dtype_by_name(self.facts.dtype).itemsize

    async def start(self) -> None:
        """Start vLLM (tens of seconds to minutes) without blocking the event loop."""
        from vllm.v1.engine.async_llm import AsyncLLM

        assert self.notices is not None and self.facts is not None
        self.notices.start()
        log.info(
            "starting vLLM %s on %s: layers %s of %d, hidden %d, %s",
            self.facts.vllm_version, self.facts.model, self.facts.layer_ids,
            self.facts.num_hidden_layers, self.facts.hidden_size, self.facts.dtype,
        )
        # hsx's stat logger only (vLLM's periodic log lines stay off): it feeds hsx_kv_cache_usage.
        try:
            with self.child_output.inherited():
                self.engine = await asyncio.to_thread(
                    AsyncLLM.from_vllm_config, self.vllm_config, disable_log_stats=True,
                    stat_loggers=[self.stats.logger_factory()],
                )
        except Exception as exc:
            said = await asyncio.to_thread(self.engine_said)  # waits for the children's last output
            if said:  # vLLM's own message says only "See root cause above"
                raise StartupError(f"the vLLM engine failed to start{said}") from exc
            raise
        # Workers have mapped the arena; drop its name so nothing outlives a crash.
        self.arena.unlink()

    async def self_test(self) -> None:
        """One tiny request through the whole path: proves every layer is captured."""
        assert self.facts is not None
        ids = [i % self.facts.vocab_size for i in range(1, 5)]
        layers = list(range(len(self.facts.layer_ids)))
        reservation = self.reserve(len(ids), len(layers))
        try:
            # Not --request-timeout: the first prefill pays the engine's lazy start-up (thread
            # pools, kernels) and took over 2 s for 4 tokens on a loaded 2-core box (TP 2).
            await self.extract(ids, layers, reservation, f"hsx-self-test-{uuid.uuid4().hex[:8]}",
                               timeout=max(self.settings.request_timeout, SELF_TEST_TIMEOUT))
        except EngineFailure as exc:
            said = await asyncio.to_thread(self.engine_said)
            raise StartupError(
                f"self-test failed: {exc}{said}" if said else
                f"self-test failed: {exc}. The architecture may not expose layers {self.facts.layer_ids} "
                "through vLLM's aux-hidden-state interface."
            ) from exc
        finally:
            reservation.release()  # a no-op when the engine took the range over

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
        if self.notices is not None:
            self.notices.close()
        if self.arena is not None:
            self.arena.close()

    @property
    def dead(self) -> bool:
        return self.engine is not None and bool(self.engine.errored)

    def bytes_for(self, num_tokens: int, num_layers: int) -> int:
        assert self.facts is not None
        return num_tokens * num_layers * self.facts.hidden_size * self.itemsize

    def reserve(self, num_tokens: int, num_layers: int) -> Reservation:
        """The arena range for one request's states. Raises Overloaded (full now) or
        TooLarge (larger than the whole arena)."""
        assert self.allocator is not None
        try:
            return self.allocator.reserve(self.bytes_for(num_tokens, num_layers))
        except ArenaFull as exc:
            raise Overloaded(f"response memory is full ({exc}); retry shortly", reason="memory") from exc
        except ArenaTooSmall as exc:
            raise TooLarge(
                f"the states of {num_tokens} tokens x {num_layers} layers need {self.bytes_for(num_tokens, num_layers)} "
                f"bytes, more than the whole arena (--arena-bytes {self.settings.arena_bytes})"
            ) from exc

    async def extract(
        self, token_ids: list[int], layer_index: list[int], reservation: Reservation, request_id: str,
        timeout: float | None = None,
    ) -> dict:
        """Prefill `token_ids` into the reserved range; returns the phase timings. The
        caller keeps the reservation and releases it once the states are sent. On a
        failure while the worker may still write the range, this method takes it over
        (`hand_over`) and frees it on the worker's notice (`_release_on_notice`): the
        caller's release then does nothing."""
        from vllm import SamplingParams

        assert self.notices is not None
        key = uuid.uuid4().hex
        notice = self.notices.expect(key)
        params = SamplingParams(
            max_tokens=1,
            temperature=0.0,
            detokenize=False,
            extra_args={
                "kv_transfer_params": {
                    KV_PARAMS_KEY: {"key": key, "offset": reservation.extent.offset, "nbytes": reservation.extent.nbytes,
                            "layers": layer_index}
                }
            },
        )
        self.engine_running += 1
        # The prefill runs in its own task, never cancelled while vLLM submits it:
        # AsyncLLM.generate cancelled inside its add_request neither aborts the request
        # nor tells the scheduler, so no notice would ever free the range (a client that
        # hung up at that moment held it until request_timeout). On a hang-up or timeout
        # the request is aborted by id instead, and the task is dropped once the notice
        # says the worker is done with the range.
        prefill = asyncio.get_running_loop().create_task(self._prefill(token_ids, params, request_id, notice))
        prefill.add_done_callback(lambda t: t.cancelled() or t.exception())  # failures are raised below
        timeout = self.settings.request_timeout if timeout is None else timeout
        try:
            msg = await asyncio.wait_for(asyncio.shield(prefill), timeout)
        except BaseException as exc:
            await self._abort(request_id, prefill)
            # The engine may still write this range: free it only on the connector's notice
            # (every request the scheduler saw gets one; one vLLM refused before scheduling
            # is held until request_timeout, which hsx's own input checks make rare).
            held = reservation.hand_over()
            asyncio.get_running_loop().create_task(self._release_on_notice(notice, held, key, prefill))
            if isinstance(exc, ValueError):  # vLLM's own input checks
                raise BadInput(f"vLLM refused the input: {exc}") from exc
            if isinstance(exc, asyncio.TimeoutError):
                raise EngineTimeout(f"the engine did not finish within {timeout:.0f}s") from exc
            if type(exc).__name__ in ("EngineDeadError", "EngineGenerateError"):
                raise EngineFailure("the engine failed while serving this request") from exc
            raise
        finally:
            self.engine_running -= 1
        if not msg["ok"]:  # the notice came: nothing writes the range, the caller frees it
            raise EngineFailure(f"the engine did not deliver the hidden states ({msg.get('error')})")
        return msg["timing"]

    async def _abort(self, request_id: str, prefill: asyncio.Task) -> None:
        """Abort a request that may not have reached the engine yet. Aborting one still
        being submitted is a no-op: it then runs to completion and its notice frees the range."""
        if prefill.done():
            return
        try:
            await asyncio.shield(self.engine.abort(request_id))
        except asyncio.CancelledError:
            pass  # a second cancel while aborting: the shielded abort still goes through
        except Exception:  # the engine died: fail_all notices release the range
            log.debug("abort of %s failed", request_id, exc_info=True)

    async def _prefill(self, token_ids: list[int], params: Any, request_id: str, notice: asyncio.Future) -> dict:
        from vllm.inputs import TokensPrompt

        t0 = time.perf_counter()
        async for _ in self.engine.generate(TokensPrompt(prompt_token_ids=token_ids), params, request_id):
            pass
        t1 = time.perf_counter()
        # The output can arrive before the worker's copy notice (or after): wait for both.
        msg = await asyncio.shield(notice)
        msg["timing"] = {"engine": t1 - t0, "copy": time.perf_counter() - t1}
        return msg

    async def _release_on_notice(
        self, notice: asyncio.Future, reservation: Reservation, key: str, prefill: asyncio.Task
    ) -> None:
        try:
            await asyncio.wait_for(notice, self.settings.request_timeout)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            log.warning("no notice for aborted request %s; freeing its arena range after timeout", key)
        reservation.release()
        prefill.cancel()  # the request is in the engine or was never sent: nothing left to abort
