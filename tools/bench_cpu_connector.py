"""vLLM's stock ExampleHiddenStatesConnector with a synchronous copy, for the CPU backend.

Used only by `hsx bench` mode (b) on CPU: the stock connector pins host memory and
uses CUDA streams/events, which the CPU build of vLLM cannot do. Everything else
(one safetensors file per request, the companion `.lock` file readers wait on, the
path returned in `kv_transfer_params["hidden_states_path"]`) is the stock code, so
the benchmark measures what users of that connector have. On a GPU the benchmark
uses the stock connector itself, not this module.

Loaded by vLLM's worker processes through `kv_connector_module_path`.
"""

from __future__ import annotations

import fcntl
import os

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class _Done:
    """Stands in for a CUDA event whose copy has already completed."""

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class CpuHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (block_ids[:, None] * self._block_size + offsets[None, :]).flatten()
        num_tokens = pending.token_ids.shape[0]
        # Synchronous copy: the KV pages are reused once the request is reported done.
        states = extract_from_kv_cache(self._kv_cache, slots, num_tokens).clone()
        tensors = {"hidden_states": states, "token_ids": pending.token_ids.clone()}
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done = _Done()
        future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(lambda f, rid=pending.req_id: self._on_write_done(rid, f))
