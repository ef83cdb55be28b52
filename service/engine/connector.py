"""hsx's KV connector: hands each request's captured hidden states to the API process.

It runs inside vLLM (loaded through `kv_connector_module_path`), next to the
`extract_hidden_states` speculative method, which writes the chosen layers'
states into the KV pages of a cache-only "draft" layer. When a request finishes:

- scheduler side (EngineCore process): `request_finished` keeps the request's
  blocks alive and queues a save carrying the arena range the API process
  reserved for it (passed in `kv_transfer_params`). Aborted requests are not
  copied; the API process is told at once so it can reuse their range.
- worker side (TP rank 0): gathers the request's slots from the page cache (only
  the requested layers, `hidden_cache.gather`, in the layout of the running vLLM
  release) and copies them into the shared arena: on CUDA
  asynchronously on a side stream into the page-locked mapping, on CPU directly.
  A small thread waits for each copy and then notifies the API process over a
  ZMQ socket; `get_finished` reports the request done so its blocks are freed.

A sample larger than the API process's stream window is a *chunked save* (chunks.py):
the worker copies token ranges into the window's free slots, notifies per chunk, reuses a
slot when the API process credits it back, and reports the request finished (its blocks
freed) only after its last chunk or a cancel. It never waits for a credit: each step's bind
and `get_finished` drain the credit socket and issue what may start.

Compared with vLLM's `ExampleHiddenStatesConnector` there is no file, lock file,
safetensors serialization or read-back: one device-to-host copy into memory the
HTTP layer sends from.

When the copy starts and what it waits for (so it overlaps the next step's forward and
never waits for a later step): docs/connector-timing.md.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import TYPE_CHECKING, Any

import torch

from vllm.config import VllmConfig, get_layers_from_vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
from vllm.logger import init_logger

from hsx import lifeline
from hsx.protocol import KV_PARAMS_KEY
from hsx_service.engine import hidden_cache, vllm_compat
from hsx_service.engine.arena import SharedArena
from hsx_service.engine.chunks import CHUNKS_KEY, ChunkedSave, ChunkPlan, CreditBook, CreditInbox
from hsx_service.engine.connector_messages import HsxConnectorMetadata, Notifier, PendingSave, ready_event

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

# Under vLLM's logger tree: this code runs in vLLM's engine and worker processes, where
# only that tree is configured (VLLM_LOGGING_LEVEL), not the root logger.
logger = init_logger(f"vllm.{__name__}")
lifeline.hold()  # this engine process dies with hsx serve (also vLLM's general plugin; here should VLLM_PLUGINS omit it)

LOG_EVERY = 256


STEP_EVENTS_KEPT = 16  # worker side: bind events kept (a save needs one a step or two old)
LAST_STEP_CAP = 1 << 16  # scheduler side: bound on remembered requests (finished ones are dropped)


class HsxConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: "KVCacheConfig | None" = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        if vllm_compat.is_cpu_backend():  # in the worker that runs the model, before its first forward
            vllm_compat.request_cpu_amx()
        extra = self._kv_transfer_config.kv_connector_extra_config
        self._arena_path: str = extra["arena_path"]
        self._arena_size: int = int(extra["arena_size"])
        self._notify_address: str = extra["notify_address"]
        self._credit_address: str | None = extra.get("credit_address")
        self._group_id = self._find_group_id(kv_cache_config)
        self._block_size = (
            kv_cache_config.kv_cache_groups[self._group_id].kv_cache_spec.block_size
            if kv_cache_config is not None
            else vllm_config.cache_config.block_size
        )
        self._notifier: Notifier | None = None
        # Scheduler side.
        self._pending: dict[str, PendingSave] = {}
        self._step = 0
        self._last_step: dict[str, int] = {}  # req_id -> last step it was scheduled in
        # Worker side.
        self._kv_cache: torch.Tensor | None = None
        self._block_axis = 1
        self._arena: SharedArena | None = None
        self._is_writer = True
        self._pinned: bool | None = None
        self._copy_stream: Any = None
        # (key, kind, event, payload): kind "whole" | "chunk" | "end" | "error"; None stops the thread.
        self._copies: "queue.Queue[tuple[str, str, Any, Any] | None]" = queue.Queue()
        self._book = CreditBook()  # chunked saves (chunks.py), by key
        self._chunked: dict[str, tuple[ChunkedSave, PendingSave, torch.Tensor]] = {}  # req_id -> its save, slots
        self._credits: CreditInbox | None = None
        # req_id -> CUDA event of its copy (None: copied synchronously).
        self._copy_events: dict[str, Any] = {}
        self._step_events: dict[int, Any] = {}  # step -> CUDA event recorded at its bind
        self._finished: set[str] = set()
        self._thread: threading.Thread | None = None
        # Profile counters, logged every LOG_EVERY copies: time the worker thread spends
        # starting copies (on CUDA it should only enqueue them) and waiting for them.
        self._stats = {"copies": 0, "bytes": 0, "submit_s": 0.0, "wait_s": 0.0}

    @staticmethod
    def _find_group_id(kv_cache_config: "KVCacheConfig | None") -> int:
        if kv_cache_config is None:
            return 0
        from vllm.v1.kv_cache_interface import HiddenStateCacheSpec

        groups = kv_cache_config.kv_cache_groups
        ids = [i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, HiddenStateCacheSpec)]
        if len(ids) == 1:
            return ids[0]
        if not ids and len(groups) == 1:
            return 0
        # One group of vLLM's HiddenStateCacheSpec is what extract_hidden_states sets up, beside
        # the model's own attention groups (full, sliding, MLA or Mamba alike): the states are
        # the residual stream, captured whatever the attention.
        raise ValueError(f"hsx: expected one hidden-states KV cache group, found {len(ids)} among {len(groups)} groups")

    @property
    def requires_kv_delivery(self) -> bool:
        # vLLM 0.32+: a request preempted while its states are still to be copied is
        # recomputed instead of finishing on blocks its preemption freed (the producer
        # default, stated here because hsx must never copy from freed blocks).
        return True

    def get_finished_count(self) -> int | None:
        return 1  # only TP rank 0 copies, so one notice per request

    def _notify(self) -> Notifier:
        if self._notifier is None:
            self._notifier = Notifier(self._notify_address)
        return self._notifier

    # ---------------------------------------------------------------- scheduler side
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request: "Request", blocks: Any, num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        self._step += 1
        for req_id in scheduler_output.num_scheduled_tokens:
            self._last_step[req_id] = self._step
        if len(self._last_step) > LAST_STEP_CAP:  # never expected: each finished request drops its entry
            self._last_step = {r: s for r, s in self._last_step.items() if s > self._step - STEP_EVENTS_KEPT}
        meta = HsxConnectorMetadata(saves=list(self._pending.values()), step=self._step)
        self._pending.clear()
        return meta

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        last_step = self._last_step.pop(request.request_id, -1)
        params = (request.kv_transfer_params or {}).get(KV_PARAMS_KEY)
        if not params:
            return False, None
        key = params["key"]
        num_tokens = len(request.prompt_token_ids or [])
        if request.status == RequestStatus.FINISHED_ABORTED or not block_ids or request.num_computed_tokens < num_tokens:
            # Nothing complete to copy: release the arena range now.
            self._notify().send(key, False, "aborted", end=True)
            return False, None
        self._pending[request.request_id] = PendingSave(
            req_id=request.request_id,
            key=key,
            block_ids=list(block_ids),
            num_tokens=num_tokens,
            offset=int(params["offset"]),
            nbytes=int(params["nbytes"]),
            layer_positions=list(params["layer_positions"]),
            last_step=last_step,
            chunks=params.get(CHUNKS_KEY),
        )
        return True, None

    def request_finished_all_groups(
        self, request: "Request", block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        ids = block_ids[self._group_id] if 0 <= self._group_id < len(block_ids) else []
        return self.request_finished(request, ids)

    # ------------------------------------------------------------------- worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionLayer

        self._is_writer = get_tensor_model_parallel_rank() == 0
        layers = get_layers_from_vllm_config(self._vllm_config, CacheOnlyAttentionLayer, list(kv_caches.keys()))
        if len(layers) != 1:
            raise ValueError(f"hsx: expected one cache-only hidden-states layer, found {len(layers)}")
        self._kv_cache = kv_caches[next(iter(layers))]
        import vllm

        self._block_axis = vllm_compat.hidden_states_block_axis(vllm.__version__)
        spec = self._vllm_config.speculative_config
        num_layers = len(getattr(spec.draft_model_config.hf_config, "eagle_aux_hidden_state_layer_ids", []))
        hidden_cache.check_view(tuple(self._kv_cache.shape), self._block_axis, num_layers,
                                self._vllm_config.model_config.get_hidden_size(), self._block_size)
        logger.info("hsx connector: vLLM %s, %s, hidden-states cache view %s %s (block offsets on axis %d)",
                    vllm.__version__, vllm_compat.model_runner_name(vllm_compat.calling_worker_module()), tuple(self._kv_cache.shape),
                    self._kv_cache.dtype, self._block_axis)
        if not self._is_writer:
            return
        self._arena = SharedArena.attach(self._arena_path, self._arena_size)
        if self._kv_cache.is_cuda:
            # Page-lock the arena so device-to-host copies run at full DMA speed
            # (pageable memory measured ~1.1 GB/s vs ~51 GB/s pinned on an H200).
            whole = torch.frombuffer(self._arena.view, dtype=torch.uint8)
            err = torch.cuda.cudart().cudaHostRegister(whole.data_ptr(), self._arena.size, 0)
            self._pinned = whole[:1].is_pinned()
            if int(err) != 0 or not self._pinned:
                logger.warning("hsx: cudaHostRegister gave %s, pinned=%s; copies will be slower", err, self._pinned)
            self._copy_stream = torch.cuda.Stream()
        if self._credit_address:
            self._credits = CreditInbox(self._credit_address)
        self._thread = threading.Thread(target=self._notify_loop, name="hsx-notify", daemon=True)
        self._thread.start()

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._mark_step(connector_metadata)
        self._start_saves(connector_metadata)  # the step begins: copy what finished before it

    def _mark_step(self, meta: KVConnectorMetadata) -> None:
        """An event on the compute stream at this step's start: every earlier step's
        work (forward, sampling, the drafter writing the states) is before it."""
        if not (isinstance(meta, HsxConnectorMetadata) and self._is_writer and self._copy_stream is not None):
            return
        if meta.step < 0 or meta.step in self._step_events or torch.cuda.is_current_stream_capturing():
            return
        event = torch.cuda.Event()
        event.record()
        self._step_events[meta.step] = event
        for old in [s for s in self._step_events if s <= meta.step - STEP_EVENTS_KEPT]:
            del self._step_events[old]

    def _start_saves(self, meta: KVConnectorMetadata) -> None:
        if isinstance(meta, HsxConnectorMetadata) and self._is_writer and not meta.started:
            meta.started = True
            for save in meta.saves:
                self._start_copy(save)
        self._pump_chunks()

    def start_load_kv(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        pass  # the cache-only layer already wrote the states during the forward

    def wait_for_save(self) -> None:
        pass

    def _gather(self, save: PendingSave) -> torch.Tensor:
        assert self._kv_cache is not None
        slots = hidden_cache.slot_ids(save.block_ids, self._block_size, save.num_tokens)
        return hidden_cache.gather(self._kv_cache, slots, self._block_axis, save.layer_positions)  # [T, L, H]

    def _destination(self, save: PendingSave, like: torch.Tensor) -> torch.Tensor:
        assert self._arena is not None
        if like.numel() * like.element_size() != save.nbytes:
            raise ValueError(f"hsx: states are {tuple(like.shape)} {like.dtype}, arena range holds {save.nbytes} bytes")
        view = self._arena.view[save.offset : save.offset + save.nbytes]
        return torch.frombuffer(view, dtype=like.dtype).view(like.shape)

    def _start_copy(self, save: PendingSave) -> None:
        t0 = time.perf_counter()
        try:
            self._submit_copy(save)
        finally:
            st = self._stats
            st["copies"] += 1
            st["bytes"] += save.nbytes
            st["submit_s"] += time.perf_counter() - t0
            if st["copies"] % LOG_EVERY == 0:
                logger.info("hsx connector: %d copies, %.2f GB, %.3fs submitting, %.3fs waiting (pinned arena: %s)",
                            st["copies"], st["bytes"] / 1e9, st["submit_s"], st["wait_s"], self._pinned)

    def _submit_copy(self, save: PendingSave) -> None:
        self._copy_events[save.req_id] = None
        if save.chunks is not None:
            try:
                self._start_chunked(save)
            except Exception as exc:  # a bad plan must not take the engine down
                logger.exception("hsx: chunked save for %s failed", save.key)
                self._copies.put((save.key, "end", None, repr(exc)))
            return
        try:
            if self._copy_stream is None:
                states = self._gather(save)
                self._destination(save, states).copy_(states)
                self._copies.put((save.key, "whole", None, None))
                return
            ready = ready_event(self._step_events, save.last_step)
            if ready is None:  # everything enqueued so far: safe, possibly a step late
                ready = torch.cuda.Event()
                ready.record()
            self._copy_stream.wait_event(ready)
            with torch.cuda.stream(self._copy_stream):
                states = self._gather(save)
                self._destination(save, states).copy_(states, non_blocking=True)
                done = torch.cuda.Event()
                done.record(self._copy_stream)
            self._copy_events[save.req_id] = done
            self._copies.put((save.key, "whole", done, states))  # keep `states` alive until the copy ends
        except Exception as exc:  # a bad range must not take the engine down
            logger.exception("hsx: copy for %s failed", save.key)
            self._copies.put((save.key, "error", None, repr(exc)))

    # Chunked saves (chunks.py): the copies start as slots are free, from the engine's own
    # calls (each step's bind and get_finished), never waiting for a credit there.
    def _start_chunked(self, save: PendingSave) -> None:
        assert self._kv_cache is not None
        chunked = ChunkedSave(save.key, save.num_tokens, ChunkPlan.from_params(save.chunks))
        slots = hidden_cache.slot_ids(save.block_ids, self._block_size, save.num_tokens)
        self._chunked[save.req_id] = (chunked, save, slots)
        self._book.add(chunked)
        if self._copy_stream is not None:  # later chunks follow on the same stream
            ready = ready_event(self._step_events, save.last_step)
            if ready is None:
                ready = torch.cuda.Event()
                ready.record()
            self._copy_stream.wait_event(ready)

    def _pump_chunks(self) -> None:
        if not self._chunked:
            return
        if self._credits is not None:
            for msg in self._credits.drain():
                self._book.apply(msg)
        for req_id, (chunked, save, slots) in self._chunked.items():
            if chunked.ended:
                continue
            try:
                for index, slot, start, stop in chunked.ready():
                    self._copy_chunk(req_id, chunked, save, slots, index, slot, start, stop)
            except Exception as exc:  # a bad range must not take the engine down
                logger.exception("hsx: chunk copy for %s failed", save.key)
                chunked.cancel()
                chunked.ended = True
                self._copies.put((save.key, "end", None, repr(exc)))
                continue
            if chunked.issued_all:
                chunked.ended = True  # after every copy it issued, in the notify thread's order
                self._copies.put((save.key, "end", None, "cancelled" if chunked.cancelled else None))

    def _copy_chunk(self, req_id: str, chunked: ChunkedSave, save: PendingSave, slots: torch.Tensor,
                    index: int, slot: int, start: int, stop: int) -> None:
        assert self._kv_cache is not None and self._arena is not None
        plan = chunked.plan
        nbytes = (stop - start) * plan.token_bytes
        offset = plan.slots[slot]
        info = {"chunk": index, "slot": slot}

        def gather_into() -> torch.Tensor:
            states = hidden_cache.gather(self._kv_cache, slots[start:stop], self._block_axis, save.layer_positions)
            if states.numel() * states.element_size() != nbytes:
                raise ValueError(f"hsx: chunk states are {tuple(states.shape)}, the slot holds {nbytes} bytes")
            dest = torch.frombuffer(self._arena.view[offset : offset + nbytes], dtype=states.dtype).view(states.shape)
            dest.copy_(states, non_blocking=self._copy_stream is not None)
            return states

        if self._copy_stream is None:
            gather_into()
            self._copies.put((save.key, "chunk", None, info))
            self._stats["bytes"] += nbytes
            return
        with torch.cuda.stream(self._copy_stream):
            states = gather_into()
            done = torch.cuda.Event()
            done.record(self._copy_stream)
        self._copy_events[req_id] = done  # the last one issued: get_finished waits for it
        self._copies.put((save.key, "chunk", done, (info, states)))  # `states` lives until the copy ends
        self._stats["bytes"] += nbytes

    def _notify_loop(self) -> None:
        notifier = self._notify()
        while True:
            item = self._copies.get()
            if item is None:
                return
            key, kind, event, payload = item
            if kind == "error":
                notifier.send(key, False, str(payload))
                continue
            if kind == "end":  # every copy of this key issued before it has been waited for
                notifier.send(key, payload is None, payload, end=True)
                continue
            if event is not None:
                t0 = time.perf_counter()
                event.synchronize()
                self._stats["wait_s"] += time.perf_counter() - t0
            if kind == "chunk":
                info = payload[0] if isinstance(payload, tuple) else payload
                notifier.send(key, True, None, **info)
            else:
                notifier.send(key, True)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.has_connector_metadata():
            self._start_saves(self._get_connector_metadata())
        self._pump_chunks()
        # A request is done sending once its copy has landed; only the writer
        # reports, and only requests it copied (as get_finished_count says).
        self._finished.update(finished_req_ids)
        done: set[str] = set()
        for req_id in list(self._finished):
            chunked = self._chunked.get(req_id)
            if chunked is not None and not chunked[0].ended:
                continue  # chunks still to copy: its blocks stay held
            if req_id in self._copy_events:
                event = self._copy_events[req_id]
                if event is not None and not event.query():
                    continue
                del self._copy_events[req_id]
                if chunked is not None:
                    del self._chunked[req_id]
                    self._book.drop(chunked[0].key)
                done.add(req_id)
            self._finished.discard(req_id)
        return done or None, None

    def shutdown(self) -> None:
        if self._thread is not None:
            self._copies.put(None)
